"""Two things ZeRO-3 needs at run time that DeepSpeed does not do for a model built outside `deepspeed.zero.Init`
(ours are built on the meta device, then partitioned): what entering zero.Init would have installed, and a
work-around for its NVMe prefetch. Both are process-wide and idempotent, as DeepSpeed's own patches are."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_dist._compat.deepspeed import patch_swap_in, use_zero3_linear


def prepare_zero3_runtime(config: dict[str, Any]) -> None:
    """Both, as the resolved config asks (`memory_efficient_linear`, DeepSpeed's own switch, defaults to on)."""
    if (config.get("zero_optimization") or {}).get("memory_efficient_linear", True):
        use_memory_efficient_linear()
    swap_in_each_parameter_once()


def use_memory_efficient_linear() -> None:
    """What entering `deepspeed.zero.Init` does (and leaves in place): replace `torch.nn.functional.linear` by
    ZeRO-3's own, which saves the weight parameter for backward instead of a view of its data.

    ZeRO-3 frees each gathered weight after its module's forward by pointing the parameter at an empty tensor, but
    torch's linear saves `weight.t()` for backward, a view that keeps the gathered data alive: every weight of the
    model, gathered, until backward (8 GB per rank for a 2B-parameter model in fp32)."""
    use_zero3_linear()


def swap_in_each_parameter_once() -> None:
    """DeepSpeed 0.19.8's NVMe prefetch reads ahead in the step's parameter trace and can queue a parameter twice
    when both its uses (at the end of forward, then at the start of backward) fall inside its look-ahead window;
    the swapper then fails with "param N already assigned swap buffer id". Each parameter is read once."""
    def each_once(swap_in: Callable) -> Callable:
        def swap_in_once(self, params, async_op=True, swap_in_buffers=None):
            if swap_in_buffers is None:  # buffers given are matched to params by position: leave those calls alone
                params = list({id(param): param for param in params}.values())
            return swap_in(self, params, async_op=async_op, swap_in_buffers=swap_in_buffers)

        return swap_in_once

    patch_swap_in(each_once)
