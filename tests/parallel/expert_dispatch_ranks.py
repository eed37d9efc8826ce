"""Two gloo ranks split a layer's experts (lightning_dist/parallel/expert_parallel) and compare, on each rank, the
outputs and gradients with the unsplit experts run on every rank's tokens: `python -m tests.parallel.
expert_dispatch_ranks DIR` writes each rank's largest differences to DIR/rank{r}.json. Rank 0's tokens choose
experts 0 and 1 only, rank 1's 0 and 3: expert 2 (held by rank 1) gets no token at all, expert 3 only rank 1's.
The layouts: a list of modules; transformers' fused experts, Mixtral's and GPT-OSS's (transposed, gate and up
interleaved, with biases); and those with PEFT's LoRA on both their weights (`target_parameters`, as a user's
all-linear puts them on Mixtral's, or names them on GPT-OSS's), called through PEFT's wrapper as the model calls it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from lightning_dist._compat.peft import parameter_adapters
from lightning_dist.lifecycle.process_exit import close_process_group
from lightning_dist.models.gpt_moe import RoutedExperts, expert_mlp
from lightning_dist.parallel.expert_parallel.layers import split_experts

D, EXPERTS, TOKENS = 8, 4, 6
CHOICES = {0: (0, 1), 1: (0, 3)}
KINDS = ("module_list", "fused", "fused_lora", "gpt_oss", "gpt_oss_lora")


class Layer(torch.nn.Module):
    """Where a model holds its experts: PEFT finds their parameters by name from here."""

    def __init__(self, experts: torch.nn.Module) -> None:
        super().__init__()
        self.experts = experts


def experts_of(kind: str) -> tuple[torch.nn.Module, str]:
    """The layer and the name of its experts module that expert parallelism splits."""
    torch.manual_seed(0)
    if kind == "module_list":
        return Layer(RoutedExperts(expert_mlp(D) for _ in range(EXPERTS))), "experts"
    layer = Layer(fused_experts(kind.removesuffix("_lora")))
    if kind in FUSED:
        for parameter in layer.parameters():
            torch.nn.init.normal_(parameter, std=0.2)
        return layer, "experts"
    from peft import LoraConfig, inject_adapter_in_model

    layer.requires_grad_(False)
    layer = inject_adapter_in_model(LoraConfig(r=2, target_modules=[], target_parameters=[
        "experts.gate_up_proj", "experts.down_proj"]), layer)
    for parameter in layer.parameters():
        torch.nn.init.normal_(parameter, std=0.2)  # LoRA's B starts at zeros: A's gradient would be zeros too
    return layer, "experts.base_layer.base_layer"


FUSED = ("fused", "gpt_oss")


def fused_experts(kind: str) -> torch.nn.Module:
    """transformers' fused experts: Mixtral's (gate and up concatenated, each expert's weights (out, in)), or
    GPT-OSS's (gate and up interleaved, (in, out), with biases)."""
    if kind == "gpt_oss":
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        return GptOssExperts(GptOssConfig(hidden_size=D, intermediate_size=2 * D, num_local_experts=EXPERTS))
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    return MixtralExperts(MixtralConfig(hidden_size=D, intermediate_size=2 * D, num_local_experts=EXPERTS))


def inputs_of(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10 + rank)
    hidden = torch.randn(TOKENS, D, generator=generator, requires_grad=True)
    chosen = torch.tensor(CHOICES[rank]).repeat(TOKENS, 1)
    weights = torch.rand(TOKENS, 2, generator=generator).softmax(-1).requires_grad_()
    return hidden, chosen, weights, torch.randn(TOKENS, D, generator=generator)


def largest_differences(kind: str, rank: int) -> dict[str, float]:
    (whole, _), (split, name) = experts_of(kind), experts_of(kind)
    split_experts(name, split.get_submodule(name), init_device_mesh("cpu", (2,)), rank,
                  parameter_adapters(split, name))
    differences: dict[str, object] = {}
    for source in (0, 1):  # the unsplit experts on both ranks' tokens: their gradients add up (to twice the mean)
        hidden, chosen, weights, upstream = inputs_of(source)
        out = whole.experts(hidden, chosen, weights)
        (out * upstream).sum().backward()
        if source == rank:
            expected = (out.detach(), hidden.grad.clone(), weights.grad.clone())
    # An expert no token chose has no gradient unsplit; split, its holder gives it a zero one (FSDP waits for it).
    reference_grads = {name: torch.zeros_like(p) if p.grad is None else p.grad for name, p in whole.named_parameters()
                       if p.requires_grad}
    hidden, chosen, weights, upstream = inputs_of(rank)
    out = split.experts(hidden, chosen, weights)
    (out * upstream).sum().backward()
    for what, ours, theirs in zip(("output", "hidden grad", "weights grad"), (out, hidden.grad, weights.grad),
                                  expected):
        differences[what] = (ours - theirs).abs().max().item()
    for parameter_name, parameter in split.named_parameters():
        if not parameter.requires_grad:
            continue
        grad = parameter.grad.to_local() if hasattr(parameter.grad, "to_local") else parameter.grad
        full = reference_grads[parameter_name]
        if hasattr(parameter, "to_local"):  # a fused parameter: this rank's experts' slice
            local = parameter.to_local().shape[0]
            full = full[rank * local:(rank + 1) * local]
        elif not parameter_name.startswith(f"{name}."):  # LoRA's, whole on every rank: FSDP averages them over all
            dist.all_reduce(grad, op=dist.ReduceOp.AVG)
        # The mean over the group's 2 ranks: FSDP averages it over the ranks left to the expert, not over all.
        differences[f"grad {parameter_name}"] = (grad - full / 2).abs().max().item()
    if kind.endswith("_lora"):  # adapters disabled (PEFT's `disable_adapter()`, a DPO reference's forward): the base's
        for module in (*whole.modules(), *split.modules()):
            if hasattr(module, "enable_adapters"):
                module.enable_adapters(False)
        with torch.no_grad():
            hidden, chosen, weights, _ = inputs_of(rank)
            base = whole.experts(hidden, chosen, weights)
            differences["output, adapters disabled"] = (split.experts(hidden, chosen, weights) - base).abs().max().item()
    differences["held"] = sorted(held for held, _ in split.get_submodule(name).named_parameters())
    return differences


def main(rank: int, directory: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results = {kind: largest_differences(kind, rank) for kind in KINDS}
    Path(directory, f"rank{rank}.json").write_text(json.dumps(results))
    # Not dist.destroy_process_group alone: the backward's all-to-alls leave gloo workers that abort the process if
    # the interpreter finalizes before they finish (seen in CI: SIGABRT, "terminate called without an active
    # exception"); close_process_group waits for them, as a training run's exit does.
    close_process_group()


if __name__ == "__main__":
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(probe.getsockname()[1])
    mp.spawn(main, args=(sys.argv[1],), nprocs=2)
