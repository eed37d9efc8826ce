"""The norm of a model's gradients when they are DTensors of more than one device mesh, and clipping by it.

Under FSDP + tensor parallelism the split layers' gradients live on the data x tensor mesh and the rest (embeddings,
norms) on the data-parallel mesh. `torch.nn.utils.clip_grad_norm_` stacks every gradient's norm into one DTensor,
which refuses operands of two meshes ("All operands in aten.stack.default must have the same mesh"), and scales them
in one foreach call, which refuses them too. Here each mesh's norm is reduced over its own ranks first, then the
plain results are combined (what torchtitan's `clip_grad_norm_` does for pipeline stages), and each mesh's gradients
are scaled by their own call. Under pipeline parallelism each stage's part is combined over the pipeline ranks as
well.

A mesh's norm is taken from the rank's local shards (torch's foreach norm over plain tensors), then reduced over the
mesh dimensions that split them: DTensor's own computation gives the same number, but dispatches each gradient's
norm, which the training monitor pays every step (`python -m benchmarks.gradient_norm`: 388 gradients, BENCHMARKS.md).
Each placement's rule is checked once (the shards it sums over hold each element once: their counts, reduced the same
way), and a difference stops the run in one line: FSDPStrategy checks at set-up, over the parameters (placed as their
gradients will be), since a check reads on the host; a placement first met in a step is checked there.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_dist._compat.fake_tensors import is_fake
from lightning_dist._compat.torch import local_tensor


def _by_mesh(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` grouped by their device mesh (plain tensors together): torch's foreach kernels, which clipping and
    the norm use, take one mesh per call."""
    groups: dict[object, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.device_mesh if isinstance(tensor, DTensor) else None, []).append(tensor)
    return list(groups.values())


def total_norm(grads: Iterable[torch.Tensor], norm_type: float = 2.0, across: Any = None) -> torch.Tensor:
    """The `norm_type`-norm of all `grads` together: a plain tensor, the same on every rank. `across`: a process
    group whose ranks each hold other parameters of the model (pipeline stages), whose norms are combined too."""
    norms = [_mesh_norm(group, norm_type) for group in _by_mesh(grads)]
    if not norms:
        norms.append(torch.zeros(()))
    if len(norms) == 1 and across is None:
        return norms[0]
    stacked = torch.stack([norm.to(norms[0].device) for norm in norms])
    if across is None:
        return stacked.max() if math.isinf(norm_type) else stacked.pow(norm_type).sum().pow(1.0 / norm_type)
    if math.isinf(norm_type):
        total = stacked.max()
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=across)
        return total
    total = stacked.pow(norm_type).sum()
    dist.all_reduce(total, group=across)
    return total.pow(1.0 / norm_type)


def check_placements(parameters: Iterable[torch.Tensor]) -> None:
    """Check the rule of `_norm_of_shards` for each placement among the DTensor `parameters` that train, not checked
    yet: a model's, once it is sharded, whose gradients are placed as they are, so that no training step reads on the
    host for it (a check reads one count). A placement first met in a step is checked there."""
    for group in _by_mesh(p for p in parameters if p.requires_grad):
        if isinstance(group[0], DTensor):
            _check_new_placements(_by_placements(group), group[0].device_mesh)


def _by_placements(grads: list[torch.Tensor]) -> dict[tuple, list[DTensor]]:
    by_placements: dict[tuple, list[DTensor]] = {}
    for grad in cast(list[DTensor], grads):
        by_placements.setdefault(grad.placements, []).append(grad)
    return by_placements


def _mesh_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of `grads`, all plain or all DTensors of one mesh, as a plain tensor the same on every rank."""
    if not isinstance(grads[0], DTensor):
        return torch.nn.utils.get_total_norm(grads, norm_type)
    by_placements = _by_placements(grads)
    by_parts = norm_type == math.inf or 0 < norm_type < math.inf  # a norm the shards' norms combine into
    if (not by_parts or any(placement.is_partial() for placements in by_placements for placement in placements)
            or _without_values(local_tensor(grads[0]))):
        # An unreduced gradient's shards are summands, not parts: only DTensor's own computation reduces them first.
        # A dry run's fake tensors go through it too: its functional collectives never resolve a process group,
        # which the fake process group cannot give for a mesh that an earlier layout in the same process made.
        return _whole(torch.nn.utils.get_total_norm(grads, norm_type))
    mesh = grads[0].device_mesh
    _check_new_placements(by_placements, mesh)
    return _norm_of_shards(by_placements, mesh, norm_type)


def _without_values(tensor: torch.Tensor) -> bool:
    return tensor.is_meta or is_fake(tensor)


def _whole(norm: torch.Tensor) -> torch.Tensor:
    """DTensor's norm of DTensors, reduced: a plain tensor, the same on every rank."""
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _split_over(placements: tuple, mesh: Any) -> tuple[int, ...]:
    """The mesh dims whose ranks hold different parts of a tensor placed so: every placement but Replicate (Shard,
    and FSDP's `_StridedShard` under tensor parallelism, which is not a Shard: its `is_shard()` is False)."""
    return tuple(dim for dim, placement in enumerate(placements) if not placement.is_replicate() and mesh.size(dim) > 1)


def _norm_of_shards(by_placements: dict[tuple, list[DTensor]], mesh: Any, norm_type: float) -> torch.Tensor:
    """Each rank's local shards' norm, reduced over the mesh dims that split them."""
    by_split: dict[tuple[int, ...], list[torch.Tensor]] = {}  # the mesh dims that split them -> local shards
    for placements, grads in by_placements.items():
        by_split.setdefault(_split_over(placements, mesh), []).extend(local_tensor(grad) for grad in grads)
    parts = []
    for split_over, shards in by_split.items():
        held = [shard for shard in shards if shard.numel()]  # a rank's shard may be empty: no max over nothing
        local = torch.nn.utils.get_total_norm(held, norm_type) if held else shards[0].new_zeros(())
        part = local if math.isinf(norm_type) else local.pow(norm_type)
        for dim in split_over:
            dist.all_reduce(part, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM,
                            group=mesh.get_group(dim))
        parts.append(part)
    combined = torch.stack(parts)
    return combined.max() if math.isinf(norm_type) else combined.sum().pow(1.0 / norm_type)


# The (mesh, placements) whose rule has been checked, once each.
_CHECKED: set[tuple] = set()


def _check_new_placements(by_placements: dict[tuple, list[DTensor]], mesh: Any) -> None:
    for placements, tensors in by_placements.items():
        if (mesh, placements) not in _CHECKED:
            _check_rule(placements, tensors, mesh)
            _CHECKED.add((mesh, placements))


def _check_rule(placements: tuple, tensors: list[DTensor], mesh: Any) -> None:
    """Stop, in one line, where the shards that `_norm_of_shards` sums over do not hold each element of `tensors`
    once: their element counts, summed over the same mesh dims, against the tensors'. A placement whose shards are not
    parts of the whole (a new kind in a torch to come), or a part taken for a copy, would make every clipped step
    wrong without a sign. Counts, not values: the parameters may not be loaded yet. The same on every rank."""
    shard = local_tensor(tensors[0])
    if _without_values(shard):  # a plan's or a dry run's: no collective answers
        return
    held = torch.tensor(float(sum(local_tensor(tensor).numel() for tensor in tensors)), dtype=torch.float64,
                        device=shard.device)
    for dim in _split_over(placements, mesh):
        dist.all_reduce(held, group=mesh.get_group(dim))
    whole = sum(tensor.numel() for tensor in tensors)
    if held.item() != whole:
        raise RuntimeError(
            f"the gradient norm of {len(tensors)} parameters placed {placements} on a {tuple(mesh.shape)} mesh would"
            f" count {held.item():.0f} elements of their {whole} (torch {torch.__version__}):"
            " lightning_dist/parallel/grad_norm.py needs that placement's rule")


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, across: Any = None,
                    skip: set[int] = frozenset()) -> torch.Tensor:  # type: ignore[assignment]
    """Scale the gradients of `parameters` so that their norm together is at most `max_norm`; returns the norm
    before clipping. `across`: as for `total_norm`; `skip`: ids of parameters whose gradient the norm counts
    elsewhere (a tied parameter's copy on another stage), which are scaled all the same."""
    parameters = [p for p in parameters if p.grad is not None]
    counted = (p.grad for p in parameters if p.grad is not None and id(p) not in skip)
    norm = total_norm(counted, norm_type, across)
    for group in _by_mesh(parameters):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm


def norms_of_each(grads: list[tuple[torch.Tensor, Any]], norm_type: float) -> list[torch.Tensor]:
    """Each gradient's `norm_type`-norm over its whole tensor, as a plain tensor the same on every rank that holds
    it. `grads`: (gradient, process group) pairs, the group holding the other parts of a plain tensor that is this
    rank's partition (ZeRO-3's), or None; a DTensor's parts are found from its mesh. One all-reduce per mesh dim or
    group, over the parts' norms."""
    norms: list[torch.Tensor | None] = [None] * len(grads)
    shared: dict[tuple, list[int]] = {}  # (mesh or process group, the mesh dims splitting them) -> indices
    for index, (grad, group) in enumerate(grads):
        if isinstance(grad, DTensor):
            if any(placement.is_partial() for placement in grad.placements) or _without_values(local_tensor(grad)):
                norms[index] = _whole(torch.linalg.vector_norm(grad, norm_type))  # summands, not parts: DTensor's
                continue
            _check_new_placements(_by_placements([grad]), grad.device_mesh)
            shared.setdefault((grad.device_mesh, _split_over(grad.placements, grad.device_mesh)), []).append(index)
        elif group is not None:
            shared.setdefault((group, None), []).append(index)
        else:
            norms[index] = grad.norm(norm_type)  # as Lightning's `grad_norm` takes it
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    for (over, split), indices in shared.items():
        parts = torch.stack([_part(grads[index][0], norm_type) for index in indices])
        for group in [over] if split is None else [over.get_group(dim) for dim in split]:
            dist.all_reduce(parts, op=op, group=group)
        whole = parts if math.isinf(norm_type) else parts.pow(1.0 / norm_type)
        for index, norm in zip(indices, whole):
            norms[index] = norm
    return norms  # type: ignore[return-value]


def _part(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    """What this rank's part of `grad` adds to its norm: its p-th power sum (its max for the inf-norm), in fp32."""
    shard = local_tensor(grad) if isinstance(grad, DTensor) else grad
    if not shard.numel():  # a rank's shard may be empty: no max over nothing
        return torch.zeros((), dtype=torch.float32, device=shard.device)
    norm = torch.linalg.vector_norm(shard, norm_type, dtype=torch.float32)
    return norm if math.isinf(norm_type) else norm.pow(norm_type)
