"""ZeRO-3 frees a gathered weight after its module's forward; torch's linear must not keep it alive until backward."""

from __future__ import annotations

import torch

from lightning_dist.strategies.deepspeed.zero3_runtime import use_memory_efficient_linear


def _views_of_weight_saved_by_linear(weight: torch.Tensor) -> list[torch.Size]:
    """Shapes of the tensors autograd saves for backward that share the weight's memory but are not the weight."""
    inputs = torch.randn(2, 3, weight.shape[1], requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        torch.nn.functional.linear(inputs, weight)
    storage = weight.untyped_storage().data_ptr()
    return [t.shape for t in saved if t.untyped_storage().data_ptr() == storage and t.shape != weight.shape]


def test_zero3_linear_saves_the_parameter_not_a_view_of_its_gathered_data():
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as patcher

    weight = torch.nn.Parameter(torch.randn(8, 4))
    torch_linear = getattr(patcher, "linear_bk", torch.nn.functional.linear)
    torch.nn.functional.linear = torch_linear
    try:
        # The control: torch saves weight.t(), which keeps the data alive after ZeRO-3 re-points the parameter.
        assert _views_of_weight_saved_by_linear(weight) == [torch.Size([4, 8])]
        use_memory_efficient_linear()
        use_memory_efficient_linear()  # idempotent: DeepSpeed's own backup of torch's linear is kept
        assert torch.nn.functional.linear is not torch_linear
        assert patcher.linear_bk is torch_linear
        assert _views_of_weight_saved_by_linear(weight) == []
    finally:
        torch.nn.functional.linear = torch_linear
