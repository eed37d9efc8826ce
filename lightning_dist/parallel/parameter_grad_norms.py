"""Lightning's `grad_norm(module, norm_type)`: each parameter's gradient norm and their total, as ddp gives them,
under every engine of ours.

Lightning's migration guide replaced `Trainer(track_grad_norm=2)` with `self.log_dict(grad_norm(self, norm_type=2))`
in `on_before_optimizer_step`. Lightning's function reads `p.grad`, which is only this rank's part of it elsewhere:
under FSDP2 a DTensor shard, whose norms its `torch.tensor(list(norms.values()))` refuses (`RuntimeError: The tensor
has a non-zero number of elements, but its data is not allocated yet`); under DeepSpeed ZeRO-1 to 3 `None`, the engine
holding the gradients in its partitions, so nothing was logged and nothing said (Lightning #7490, closed as won't
fix). While one of our strategies trains, Lightning's function runs `grad_norm` below, under whatever name a
module imported it (`_compat/lightning.py` swaps its code as training starts, and back at teardown): each norm is of
the whole gradient, as ddp's is.

What it costs a step: under FSDP2 (with tensor or context parallelism) and ZeRO-3, each rank's shards' norms and one
small all-reduce per mesh or process group; under ZeRO-1/2, DeepSpeed's `safe_get_full_grad` for each trainable
parameter, an all-reduce of its size (a LoRA's adapters: little; a full fine-tune's: its gradients once more).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_dist._compat.deepspeed import zero_gradient
from lightning_dist.parallel.grad_norm import norms_of_each

if TYPE_CHECKING:
    from collections.abc import Iterator

# The strategy training in this process (set as training starts, cleared at its teardown): the engine that holds
# the gradients and the ranks the model's parameters are spread over.
_running: Any = None


def running_under(strategy: Any) -> None:
    global _running
    _running = strategy


def run_ended() -> None:
    running_under(None)


def grad_norm(module: torch.nn.Module, norm_type: float | int | str, group_separator: str = "/"
              ) -> dict[str, torch.Tensor]:
    """Lightning's `grad_norm` (lightning/pytorch/utilities/grads.py), its keys and their order: the `norm_type`-norm
    of each parameter's gradient, whole whatever part of it this rank holds, and their total. The same on every rank
    that holds the parameter."""
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    named = dict(_gradients(module))
    each = dict(zip(named, norms_of_each(list(named.values()), norm_type)))
    stages = _running.gradient_norm_scope()[0] if _running is not None else None
    if stages is not None:
        each = _of_every_stage(each, stages, _running.root_device)
    norms = {f"grad_{norm_type}_norm{group_separator}{name}": norm for name, norm in each.items()}
    if norms:
        total = torch.stack([norm.to(torch.float32) for norm in norms.values()]).norm(norm_type)
        norms[f"grad_{norm_type}_norm_total"] = total
    return norms


def _gradients(module: torch.nn.Module) -> Iterator[tuple[str, tuple[torch.Tensor, Any]]]:
    """Each parameter's gradient as this rank holds it, and the process group holding its other parts where it is
    a plain tensor's partition: `p.grad` (a DTensor under FSDP2, which knows its parts), or DeepSpeed's, unscaled
    (whole under ZeRO-1/2, this rank's partition under ZeRO-3)."""
    engine = getattr(_running, "deepspeed_engine", None)
    if engine is not None and engine.zero_optimization_stage() < 3 and not engine.managed_gradient_accumulation():
        # Where Lightning ends each accumulation (config/resolve.py fill_accumulation_boundary), ZeRO-1/2 reduce the
        # gradients inside the step: here each rank holds its own, unreduced or in part, and the norms would be wrong.
        raise RuntimeError(
            f"grad_norm: under ZeRO-{engine.zero_optimization_stage()} with accumulate_grad_batches > 1 or manual "
            "optimization, DeepSpeed reduces the gradients inside its step, after on_before_optimizer_step, so no rank"
            " holds them whole here; use ZeRO-3 or ld_fsdp, or accumulate_grad_batches=1")
    for name, param in module.named_parameters():
        if param.grad is not None:
            yield name, (param.grad.data, None)
        elif engine is not None and param.requires_grad:
            gradient = zero_gradient(param, engine)
            if gradient is not None:
                yield name, gradient


def _of_every_stage(norms: dict[str, torch.Tensor], stages: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """Every pipeline stage's norms on each of them, in stage order: the last stage's logs are every stage's, and
    rank 0's logger writes the first stage's. A weight two stages hold (a tied one) is named once. The names travel
    as objects (a host exchange, as Lightning's own `grad_norm` reads every norm to the host), the values on the
    device."""
    names: list[Any] = [None] * dist.get_world_size(stages)
    dist.all_gather_object(names, list(norms), group=stages)
    width = max(1, *(len(stage) for stage in names))
    values = torch.zeros(width, dtype=torch.float32, device=device)
    if norms:
        values[:len(norms)] = torch.stack([norm.to(device, torch.float32) for norm in norms.values()])
    gathered = [torch.empty_like(values) for _ in names]
    dist.all_gather(gathered, values, group=stages)
    every: dict[str, torch.Tensor] = {}
    for stage_names, stage_values in zip(names, gathered):
        for name, value in zip(stage_names, stage_values):
            every.setdefault(name, value)
    return every
