"""Device discipline for collectives: every tensor a collective sees lives on the strategy's root device, and the
process group has a backend for every device that state lives on.

On CPU (gloo) any tensor works, so a tensor made in the wrong place goes unnoticed until the first CUDA run, where
NCCL refuses host tensors. Everything the package hands to a collective is made here.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lightning_dist._compat.lightning import set_threads_for_ranks
from lightning_dist._compat.torch import set_default_process_group_timeout
from lightning_dist.lifecycle.process_exit import close_process_group_at_exit
from lightning_dist.lifecycle.stop_signals import end_with_launcher

# Host state under CUDA (FSDP's offloaded shards, DeepSpeed's offloaded partitions) is reduced with gloo, device
# state with nccl: one process group with a backend per device type, as torchtitan does.
CUDA_WITH_HOST_STATE_BACKEND = "cpu:gloo,cuda:nccl"


def process_group_backend(device: torch.device, host_state: bool = False) -> str:
    """nccl on CUDA, gloo on CPU; both (per device type) where a CUDA run keeps state in host memory."""
    if device.type == "cuda":
        return CUDA_WITH_HOST_STATE_BACKEND if host_state else "nccl"
    return "gloo"


def process_group_timeout(timeout: timedelta | float | None) -> timedelta:
    """How long a collective waits for every rank before it fails (then the job ends, naming the step): a
    timedelta, or seconds as a config file gives them; None is torch's default, 30 minutes."""
    if timeout is None:
        return default_pg_timeout
    if isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(
            f"strategy.timeout={timeout!r}: give the seconds a collective may wait, a number > 0 (default 1800)"
        )
    return timedelta(seconds=timeout)


def prepare_rank(device: torch.device, processes_per_node: int, timeout: timedelta) -> None:
    """What every strategy does in a rank before its process group exists: the rank's own device, its share of the
    node's cores, `timeout` for every group, the process group closed when the process exits, and the process ended
    when the one that started it dies."""
    bind_device(device)
    share_the_cores(processes_per_node)
    use_timeout_for_every_group(timeout)
    close_process_group_at_exit()
    end_with_launcher()


def use_timeout_for_every_group(timeout: timedelta) -> None:
    """Make `timeout` the default of every process group created from now on in this process, not just the
    world group's: DeepSpeed (ZeRO's data-parallel groups) and others call `new_group` without a timeout, which
    then falls back to torch's 30 minutes (10 for NCCL) and a stuck rank would hang them that long."""
    set_default_process_group_timeout(timeout)


def bind_device(device: torch.device) -> None:
    """Make `device` this process's current CUDA device, so that NCCL, object collectives and every allocation
    without an explicit index use the rank's own GPU instead of cuda:0. Nothing to do elsewhere."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def share_the_cores(processes_per_node: int) -> None:
    """Each rank its share of the node's cores as intra-op threads, unless OMP_NUM_THREADS says otherwise.

    Lightning's launcher does this for the rank it runs in, but only after it has started the others, which keep
    torch's default of every core: on 2 cores, rank 1 computed on 2 threads beside rank 0's one, and every
    collective waited for the slower rank (FSDP 20% behind a torchrun loop, whose ranks get one thread each)."""
    set_threads_for_ranks(processes_per_node)


def gather_numbers(
    values: Sequence[float], device: torch.device, dtype: torch.dtype = torch.float64
) -> list[list[float]]:
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
