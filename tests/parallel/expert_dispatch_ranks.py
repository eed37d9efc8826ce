"""Two gloo ranks split a layer's experts (lightning_dist/parallel/expert_parallel) and compare, on each rank, the
outputs and gradients with the unsplit experts run on every rank's tokens: `python -m tests.parallel.
expert_dispatch_ranks DIR` writes each rank's largest differences to DIR/rank{r}.json. Rank 0's tokens choose
experts 0 and 1 only, rank 1's 0 and 3: expert 2 (held by rank 1) gets no token at all, expert 3 only rank 1's."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from lightning_dist.lifecycle.process_exit import close_process_group
from lightning_dist.models.gpt_moe import RoutedExperts, expert_mlp
from lightning_dist.parallel.expert_parallel.layers import split_experts

D, EXPERTS, TOKENS = 8, 4, 6
CHOICES = {0: (0, 1), 1: (0, 3)}


def experts_of(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "module_list":
        return RoutedExperts(expert_mlp(D) for _ in range(EXPERTS))
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    experts = MixtralExperts(MixtralConfig(hidden_size=D, intermediate_size=2 * D, num_local_experts=EXPERTS))
    for parameter in experts.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    return experts


def inputs_of(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10 + rank)
    hidden = torch.randn(TOKENS, D, generator=generator, requires_grad=True)
    chosen = torch.tensor(CHOICES[rank]).repeat(TOKENS, 1)
    weights = torch.rand(TOKENS, 2, generator=generator).softmax(-1).requires_grad_()
    return hidden, chosen, weights, torch.randn(TOKENS, D, generator=generator)


def largest_differences(kind: str, rank: int) -> dict[str, float]:
    whole, split = experts_of(kind), experts_of(kind)
    split_experts("experts", split, init_device_mesh("cpu", (2,)), rank)
    differences: dict[str, object] = {}
    for source in (0, 1):  # the unsplit experts on both ranks' tokens: their gradients add up (to twice the mean)
        hidden, chosen, weights, upstream = inputs_of(source)
        out = whole(hidden, chosen, weights)
        (out * upstream).sum().backward()
        if source == rank:
            expected = (out.detach(), hidden.grad.clone(), weights.grad.clone())
    # An expert no token chose has no gradient unsplit; split, its holder gives it a zero one (FSDP waits for it).
    reference_grads = {name: torch.zeros_like(p) if p.grad is None else p.grad for name, p in whole.named_parameters()}
    hidden, chosen, weights, upstream = inputs_of(rank)
    out = split(hidden, chosen, weights)
    (out * upstream).sum().backward()
    for name, ours, theirs in zip(("output", "hidden grad", "weights grad"), (out, hidden.grad, weights.grad),
                                  expected):
        differences[name] = (ours - theirs).abs().max().item()
    for name, parameter in split.named_parameters():
        grad = parameter.grad.to_local() if hasattr(parameter.grad, "to_local") else parameter.grad
        full = reference_grads[name]
        if hasattr(parameter, "to_local"):  # a fused parameter: this rank's experts' slice
            local = parameter.to_local().shape[0]
            full = full[rank * local:(rank + 1) * local]
        # The mean over the group's 2 ranks: FSDP averages it over the ranks left to the expert, not over all.
        differences[f"grad {name}"] = (grad - full / 2).abs().max().item()
    differences["held"] = sorted(name for name, _ in split.named_parameters())
    return differences


def main(rank: int, directory: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results = {kind: largest_differences(kind, rank) for kind in ("module_list", "fused")}
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
