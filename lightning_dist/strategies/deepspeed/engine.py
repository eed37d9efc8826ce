"""What our DeepSpeed strategy does to DeepSpeed's engine beyond Lightning's: the accelerator it runs on, and how a
model built without weights gets them (each rank initialises its ZeRO-3 partitions, or whole parameters)."""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from lightning_dist._compat.deepspeed import (
    partition,
    partition_elements,
    partitions_from_whole_parameters,
    remember_cpu_info,
    say_on_local_rank_zero,
    skip_shared_memory_comm_op,
)
from lightning_dist.lifecycle.op_builds import announce_op_builds
from lightning_dist.parallel.pretrained_weights import Region
from lightning_dist.parallel.sharded_init import Keep, RegionKept, give_memory, initialize_parameters
from lightning_dist.strategies.deepspeed.config.zero import ZeroSection

SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")


def say_the_host_where_there_is_no_cuda() -> None:
    """DeepSpeed picks its accelerator when first used and, where it finds none, warns on every rank that it chose
    the CPU. Without CUDA the host is the one device our strategy runs it on: said before DeepSpeed asks, so it need
    not guess. A DS_ACCELERATOR the user set stays."""
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def use_deepspeed_accelerator(device: torch.device) -> str:
    """Point DeepSpeed at the accelerator matching Lightning's device; returns its name.

    DeepSpeed picks one by itself at import (CUDA when visible), which is wrong for `accelerator="cpu"` on a GPU
    machine. The environment variable makes the choice stick in processes DeepSpeed starts from this one.
    """
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if device.type not in SUPPORTED_DEVICE_TYPES:
        raise ValueError(
            f"trainer.accelerator: DeepSpeed runs on {' or '.join(SUPPORTED_DEVICE_TYPES)} here, not {device.type!r}"
        )
    if get_accelerator().device_name() != device.type:
        if device.type == "cuda":
            from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator as Accelerator
        else:
            from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator as Accelerator
        set_accelerator(Accelerator())
    os.environ["DS_ACCELERATOR"] = device.type
    remember_cpu_info()  # before DeepSpeed loads its native ops on this rank
    announce_op_builds(say_on_local_rank_zero)
    skip_shared_memory_comm_op()
    return get_accelerator().device_name()


def zero3_partitioner(config: dict[str, Any]) -> tuple[Keep, RegionKept]:
    """Hands each initialised parameter to ZeRO-3, which keeps this rank's partition (on the device, the host or
    NVMe, as the config's `offload_param` says) and frees the rest: what `deepspeed.zero.Init` does at the end of
    each module's constructor. With it, the rows of each parameter that hold this rank's partition: all a rank reads
    of a pretrained tensor, and all it writes (on a CPU rank the rest of the parameter, never written, takes no
    memory)."""
    import deepspeed

    # Not entered: only its conversion is used, not its patching of every module class's constructor. DeepSpeed's
    # config check wants a batch size, which a run that only validates or tests has not been given (none is used).
    if "train_batch_size" not in config and "train_micro_batch_size_per_gpu" not in config:
        config = {**config, "train_micro_batch_size_per_gpu": 1}
    zero_init = deepspeed.zero.Init(config_dict_or_path=config, remote_device=ZeroSection.of(config).parameters.device)

    def rows(param: torch.nn.Parameter) -> Region | None:
        if param.dim() == 0 or not param.numel() or partitions_from_whole_parameters(zero_init):
            return None
        start, end = partition_elements(zero_init, param)
        row = math.prod(param.shape[1:])
        return (slice(start // row, -(-end // row)),)

    def keep(param: torch.nn.Parameter, part: torch.Tensor) -> None:
        # In the config's dtype (bf16, fp16), as a module built under zero.Init would be: DeepSpeed's own cast of the
        # module cannot reach partitions. A frozen weight in a float32 config stays as built (a LoRA base in its
        # bf16), as DeepSpeed's engine leaves it there. Made unwritten on the device DeepSpeed moves a parameter to
        # before it partitions it; only this rank's partition is written.
        as_built = not part.is_floating_point() or (zero_init.dtype == torch.float32 and not param.requires_grad)
        dtype = part.dtype if as_built else zero_init.dtype
        give_memory(param, torch.empty(param.shape, dtype=dtype, device=zero_init.local_device))
        read = rows(param)
        partition(zero_init, param, part.to(dtype), read[0].start * math.prod(param.shape[1:]) if read else 0)

    return keep, rows


def whole_on(device: torch.device) -> Keep:
    def keep(param: torch.nn.Parameter, full: torch.Tensor) -> None:
        give_memory(param, full.to(device))

    return keep


def initialize_deferred_parameters(
    model: torch.nn.Module, config: dict[str, Any], device: torch.device, seed: int
) -> None:
    """Each rank initialises the parameters still on the meta device (the same `seed` on every rank gives the same
    values) and keeps its ZeRO-3 partition of each, or, below stage 3, the whole parameter on `device`."""
    meta = [p for p in model.parameters() if p.is_meta]
    if ZeroSection.of(config).partitions_parameters:
        keep, rows = zero3_partitioner(config)
        initialize_parameters(model, keep, seed, params=meta, region=rows)
    else:
        initialize_parameters(model, whole_on(device), seed, params=meta)
