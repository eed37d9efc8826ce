"""The norm of a model's gradients when they are DTensors of more than one device mesh, and clipping by it.

Under FSDP + tensor parallelism the split layers' gradients live on the data x tensor mesh and the rest (embeddings,
norms) on the data-parallel mesh. `torch.nn.utils.clip_grad_norm_` stacks every gradient's norm into one DTensor,
which refuses operands of two meshes ("All operands in aten.stack.default must have the same mesh"), and scales them
in one foreach call, which refuses them too. Here each mesh's norm is reduced over its own ranks first, then the
plain results are combined (what torchtitan's `clip_grad_norm_` does for pipeline stages), and each mesh's gradients
are scaled by their own call. With one mesh (FSDP alone) it is torch's own computation. Under pipeline parallelism
each stage's part is combined over the pipeline ranks as well.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


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
    norms = []
    for group in _by_mesh(grads):
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
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
