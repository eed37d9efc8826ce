"""Device discipline for collectives: every tensor a collective sees lives on the strategy's root device, and the
process group has a backend for every device that state lives on.

On CPU (gloo) any tensor works, so a tensor made in the wrong place goes unnoticed until the first CUDA run, where
NCCL refuses host tensors. Everything the package hands to a collective is made here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

# Host state under CUDA (FSDP's offloaded shards, DeepSpeed's offloaded partitions) is reduced with gloo, device
# state with nccl: one process group with a backend per device type, as torchtitan does.
CUDA_WITH_HOST_STATE_BACKEND = "cpu:gloo,cuda:nccl"


def process_group_backend(device: torch.device, host_state: bool = False) -> str:
    """nccl on CUDA, gloo on CPU; both (per device type) where a CUDA run keeps state in host memory."""
    if device.type == "cuda":
        return CUDA_WITH_HOST_STATE_BACKEND if host_state else "nccl"
    return "gloo"


def bind_device(device: torch.device) -> None:
    """Make `device` this process's current CUDA device, so that NCCL, object collectives and every allocation
    without an explicit index use the rank's own GPU instead of cuda:0. Nothing to do elsewhere."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def gather_numbers(values: Sequence[float], device: torch.device, dtype: torch.dtype = torch.float64) -> list[list[float]]:
    """Each rank's `values` (the same length everywhere), gathered onto every rank: `[[rank 0's], [rank 1's], ...]`.

    The tensor is made on `device` (the strategy's root device), never on the host by default.
    """
    return gather_tensors(torch.tensor(list(values), dtype=dtype, device=device))


def gather_tensors(local: torch.Tensor) -> list[list[float]]:
    """Each rank's 1-D `local` (same shape and device type everywhere) as lists on every rank: one collective,
    then one read on the host."""
    if not (dist.is_available() and dist.is_initialized()):
        return [local.tolist()]
    # Concatenated rather than stacked: gloo accepts only that layout, nccl both.
    gathered = torch.empty(dist.get_world_size() * local.numel(), dtype=local.dtype, device=local.device)
    _all_gather_single(gathered, local.contiguous())
    return gathered.view(dist.get_world_size(), -1).tolist()


# torch 2.13 renamed all_gather_into_tensor (and deprecated the old name); older releases have only that.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_objects(obj: object) -> list:
    """Each rank's picklable `obj`, gathered onto every rank. torch stages the bytes on the device the process
    group's backend needs (the current CUDA device under nccl: `bind_device` makes that the rank's own)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered
