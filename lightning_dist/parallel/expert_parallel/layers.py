"""Which modules hold a mixture-of-experts layer's experts, and how expert parallelism splits them over a group.

Expert parallelism splits a layer at the call of its experts, `experts(hidden_states, top_k_index, top_k_weights)`:
the routing before it stays whole on each rank, as does whatever the layer adds after (a shared expert, the
load-balancing loss). Two layouts of that module are split:
- transformers' fused experts (`MixtralExperts`, `Qwen2MoeExperts`, `OlmoeExperts`, ...: `num_experts`, 3-D
  parameters whose first dimension is the experts): each rank keeps its experts' slice of each parameter, as a
  DTensor sharded over the expert-parallel axis, so its name and full shape stay the model's (checkpoints, FSDP's
  sharding over the ranks left to the experts). LoRA adapters PEFT put on those parameters (`target_parameters`,
  which its all-linear adds) are not split: FSDP shards them over every rank as it does the attention's, and each
  rank adds its experts' rows and columns of them to its slices as PEFT adds the whole (`_adapted`);
- an `nn.ModuleList` of one module per expert that is itself called that way (`model=gpt_moe`'s `RoutedExperts`):
  each rank keeps its experts' modules under their own names; the others' places hold `ExpertElsewhere`.
A layer that loops over its experts itself (a list without that call) cannot be split there: refused in one line.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from lightning_dist._compat.peft import active_expert_factors, run_base_layer_only
from lightning_dist._compat.torch import own_parameters_as
from lightning_dist.parallel.expert_parallel.dispatch import RunLocal, ScaleGradient, dispatch_and_combine
from lightning_dist.parallel.experts import expert_layers

KEY = "strategy.expert_parallel_size"
CALL = "experts(hidden_states, top_k_index, top_k_weights)"


def _called_with_routing(module: nn.Module) -> bool:
    forward = type(module).forward
    if forward is nn.Module.forward:
        return False
    return len(inspect.signature(forward).parameters) == 4  # self, hidden states, experts, weights


def _fused_parameters(module: nn.Module) -> list[str] | None:
    """The names of `module`'s own parameters when it is transformers-style fused experts: `num_experts`, and
    every parameter's first dimension the experts, one of them a stack of matrices (a router's is one matrix)."""
    count = getattr(module, "num_experts", None)
    own = dict(module.named_parameters(recurse=False))
    if not isinstance(count, int) or not own or not _called_with_routing(module):
        return None
    if all(p.shape[:1] == (count,) for p in own.values()) and any(p.dim() == 3 for p in own.values()):
        return list(own)
    return None


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of each experts module expert parallelism splits, in the model's order."""
    return [(name, module) for name, module in model.named_modules()
            if (isinstance(module, nn.ModuleList) and _called_with_routing(module)) or _fused_parameters(module)]


def experts_count(module: nn.Module) -> int:
    return len(module) if isinstance(module, nn.ModuleList) else int(getattr(module, "num_experts"))


def refusal(model: nn.Module, size: int) -> str | None:
    """Why `model`'s experts cannot be split over `size` ranks, in one line naming the key; None when they can."""
    modules = experts_modules(model)
    split = {id(module) for _, module in modules}
    unsplit = [name for name, layer in expert_layers(model) if id(layer.experts) not in split]
    if unsplit:
        return (f"{KEY}={size}: {unsplit[0]} calls its experts one by one itself; expert parallelism splits the"
                f" experts where a layer calls them as {CALL} (transformers' MoE models, model=gpt_moe)")
    if not modules:
        return (f"{KEY}={size}: {type(model).__name__} has no experts to split (no module called as {CALL}, as"
                " transformers' MoE models and model=gpt_moe have); set it to 1")
    for name, module in modules:
        count = experts_count(module)
        if count % size:
            return (f"{KEY}={size}: {name} has {count} experts, which do not divide over {size} ranks; choose a"
                    f" size that divides {count}")
    return None


class ExpertElsewhere(nn.Module):
    """The place of an expert held by another rank of the expert-parallel group: no parameters, never called."""

    def __init__(self, expert: int, rank: int) -> None:
        super().__init__()
        self.expert, self.rank = expert, rank

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"expert {self.expert} is held by expert-parallel rank {self.rank}: it runs only through"
                           f" {CALL}, which sends it its tokens")

    def extra_repr(self) -> str:
        return f"expert {self.expert}, on expert-parallel rank {self.rank}"


@dataclass
class SplitExperts:
    """One experts module split over an expert-parallel group: this rank holds experts `first` to
    `first + local - 1`. `calls`: how many times its call was dispatched (the axis checks each step's)."""

    name: str
    module: nn.Module
    local: int
    first: int
    calls: int = 0


def split_experts(name: str, module: nn.Module, mesh: Any, rank: int, adapters: Sequence[nn.Module] = ()
                  ) -> SplitExperts:
    """Keep this rank's (`rank` of `mesh`, the 1-D expert-parallel mesh) experts of `module` and send its calls
    through the group (dispatch.py). `adapters`: PEFT's LoRA wrappers around `module` (fused experts only). On the
    meta device too: nothing is allocated."""
    from torch.distributed.tensor import DTensor, Shard

    ranks = mesh.size()
    local = experts_count(module) // ranks
    split = SplitExperts(name, module, local, first=rank * local)
    kept = range(split.first, split.first + local)
    if isinstance(module, nn.ModuleList):
        for expert in range(len(module)):
            if expert not in kept:
                module[expert] = ExpertElsewhere(expert, expert // local)
        run_local = _run_module_list(module, module.forward, split)
    else:
        for parameter_name in _fused_parameters(module) or []:
            full = getattr(module, parameter_name)
            mine = DTensor.from_local(full.detach()[kept.start:kept.stop].clone(), mesh, [Shard(0)], run_check=False)
            setattr(module, parameter_name, nn.Parameter(mine, requires_grad=full.requires_grad))
        for wrapper in adapters:
            run_base_layer_only(wrapper)
        run_local = _run_fused(module, module.forward, split, ranks, list(adapters))
    group = mesh.get_group()

    def forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        split.calls += 1
        return dispatch_and_combine(hidden, top_k_index, top_k_weights, group=group, ranks=ranks, local=local,
                                    run_local=run_local)

    module.forward = forward  # an instance attribute: FSDP2's class swap keeps it
    return split


def _ones(rows: torch.Tensor) -> torch.Tensor:
    return torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)


def _run_module_list(module: nn.ModuleList, original: Callable[..., torch.Tensor], split: SplitExperts
                     ) -> RunLocal:
    """The list's own forward on this rank's experts. An expert no token reached is called on no rows: its
    gradient is zero, where FSDP (which shards the experts as a unit of their own) waits for one on every rank."""

    def run_local(rows: torch.Tensor, expert: torch.Tensor, rows_per_expert: list[int]) -> torch.Tensor:
        output = original(rows, (expert + split.first)[:, None], _ones(rows))
        idle = [module[split.first + index] for index, count in enumerate(rows_per_expert) if count == 0]
        return output + sum(idle_expert(rows[:0]).sum() for idle_expert in idle) if idle else output

    return run_local


def _run_fused(module: nn.Module, original: Callable[..., torch.Tensor], split: SplitExperts, ranks: int,
               adapters: list[nn.Module]) -> RunLocal:
    """The module's own forward on this rank's experts: its parameters' local slices (plain tensors: its code
    indexes them by expert), with their LoRA deltas, and `num_experts` this rank's count, for the call."""

    def run_local(rows: torch.Tensor, expert: torch.Tensor, rows_per_expert: list[int]) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        local_values = {name: p.to_local() if isinstance(p, DTensor) else p
                        for name, p in module.named_parameters(recurse=False)}
        if adapters:
            local_values = _adapted(local_values, adapters, split, ranks, module)
        count = getattr(module, "num_experts")
        setattr(module, "num_experts", split.local)
        try:
            with own_parameters_as(module, local_values):
                output = original(rows, expert[:, None], _ones(rows))
        finally:
            setattr(module, "num_experts", count)
        if rows.shape[0] == 0:  # no token came: its experts still give FSDP a (zero) gradient, as on every rank
            output = output + sum(value.sum() for value in local_values.values()) * 0.0
        return output

    return run_local


def _adapted(values: dict[str, torch.Tensor], adapters: list[nn.Module], split: SplitExperts, ranks: int,
             module: nn.Module) -> dict[str, torch.Tensor]:
    """`values` (this rank's slices of the experts' parameters) plus the LoRA delta of each parameter an adapter
    wraps, for this rank's experts: `W + scaling * lhs @ rhs` in one baddbmm with autocast off, as PEFT folds it.
    The adapters' gradients are averaged over all ranks, as the attention's weights' are, where only this rank's
    slices get one here, scaled by 1 / ranks on the way in (dispatch.py): those are scaled back by `ranks`, so that
    the average is the mean over every rank's tokens, as the experts' own is."""
    if parametrize.is_parametrized(module):
        raise RuntimeError(f"{KEY}={ranks}: {split.name}'s LoRA adapters were added to its whole parameters"
                           " (PEFT's forward ran, not expert parallelism's): call the experts module as"
                           f" {CALL}")
    adapted = dict(values)
    experts = slice(split.first, split.first + split.local)
    for wrapper in adapters:
        if getattr(wrapper, "merged"):
            raise RuntimeError(f"{KEY}={ranks}: {split.name}'s LoRA adapters were merged into its weights, which"
                               " expert parallelism holds split; unmerge them (or merge after training)")
        name = getattr(wrapper, "parameter_name")
        for lhs, rhs, scaling in active_expert_factors(wrapper, experts):
            with torch.autocast(device_type=lhs.device.type, enabled=False):
                adapted[name] = torch.baddbmm(adapted[name], ScaleGradient.apply(lhs, float(ranks)),
                                              ScaleGradient.apply(rhs, float(ranks)), alpha=scaling)
    return adapted
