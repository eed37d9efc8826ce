"""FSDP2 (`fully_shard`) applied per block class and then at the root, the layout torchtitan uses."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor, Shard

from lightning_dist._compat.torch import (
    CheckpointWrapper,
    apply_to_tensors,
    local_shard_region,
    reopen_fsdp_forward,
    wrapped_module,
)
from lightning_dist.parallel.sharded_init import initialize_parameters


def offload_policy(cpu_offload: bool, device: torch.device) -> OffloadPolicy:
    # Pinned host memory only speeds up copies to an accelerator; on a CPU-only machine pinning itself fails.
    return CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy | None:
    """bf16-mixed the FSDP2 way (as torchtitan does): fp32 shards stay the master weights, parameters are
    all-gathered in bf16 for compute (half the traffic), gradients are reduced in fp32."""
    if precision != "bf16-mixed":
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _block_units(model: nn.Module, block_classes: tuple[type[nn.Module], ...]) -> list[nn.Module]:
    """Each block, or its activation-checkpoint wrapper where it has one: FSDP must shard the wrapper (as torchtitan
    does) so that the parameters are gathered before backward recomputes the block."""
    wrapped = {id(wrapped_module(m)) for m in model.modules() if isinstance(m, CheckpointWrapper)}
    return [
        module
        for module in model.modules()
        if id(module) not in wrapped
        and isinstance(wrapped_module(module) if isinstance(module, CheckpointWrapper) else module, block_classes)
    ]


def apply_fully_shard(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    block_classes: tuple[type[nn.Module], ...],
    reshard_after_forward: bool,
    offload: OffloadPolicy,
    mixed_precision: MixedPrecisionPolicy | None = None,
    forward_methods: Iterable[str] = (),
    experts: Iterable[nn.Module] = (),
    experts_mesh: DeviceMesh | None = None,
) -> int:
    """Shard each submodule of one of `block_classes` as its own unit, then the root; returns the number of FSDP units.
    Under expert parallelism, each of `experts` (a layer's experts modules) is a unit first, over `experts_mesh`: the
    ranks left to its experts (their gradients come scaled for that mesh: parallel/expert_parallel/dispatch.py).

    Blocks go first because `fully_shard` claims the parameters not yet claimed by a sharded descendant: the root
    is left with what lies outside the blocks (embeddings, head). Already-sharded modules are left alone, so calling
    this again (fit, then test) changes nothing. `forward_methods` are root methods other than `forward` that run
    the model (e.g. Lightning's `training_step`): they must gather the root's parameters just as `forward` does.
    """
    kwargs: dict[str, Any] = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, offload_policy=offload)
    if mixed_precision is not None:
        kwargs["mp_policy"] = mixed_precision
    for unit in experts:
        if not isinstance(unit, FSDPModule):
            assert experts_mesh is not None, "experts are sharded over the ranks left to them"
            placement = functools.partial(_experts_placement, ranks=experts_mesh.size())
            fully_shard(unit, **{**kwargs, "mesh": experts_mesh, "shard_placement_fn": placement})
    for unit in _block_units(model, block_classes):
        if not isinstance(unit, FSDPModule):
            fully_shard(unit, **kwargs)
    if not isinstance(model, FSDPModule):
        # The root stays gathered after forward: backward needs it at once, so freeing it would only re-gather.
        fully_shard(model, **{**kwargs, "reshard_after_forward": False})
        for method in forward_methods:
            register_step_method(model, method)
    return sum(isinstance(m, FSDPModule) for m in model.modules())


def _experts_placement(parameter: nn.Parameter, ranks: int) -> Shard:
    """Where FSDP cuts an experts unit's parameter over its `ranks`: the experts dimension, unless this rank holds
    fewer experts than there are ranks (transformers' fused experts: a rank's slice of each 3-D parameter), which
    would leave whole experts on some ranks and none on others (measured: Mixtral at ep 8 on 16 ranks, rank 0's
    optimizer state 3.28 MB, rank 15's 0.13); then the next dimension, as torchtitan shards its experts."""
    local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
    return Shard(1) if local.dim() > 1 and local.shape[0] < ranks else Shard(0)


def register_step_method(model: nn.Module, name: str) -> None:
    """`register_fsdp_forward_method` for a Lightning step method, which usually calls `forward` itself.

    FSDP2 counts that nested `forward` as a pass of its own: its end marks the root idle, so the step method's end
    frees the root's parameters although the root keeps them after forward, and backward gathers them again. One
    all-gather of the root too many per step (the default model: 4 ms a step, measured with torch.profiler).
    Reopening the pass when the method returns leaves the end of the pass to the method, as for a plain `forward`."""
    method = getattr(model, name)

    @functools.wraps(method)
    def step(*args: Any, **kwargs: Any) -> Any:
        output = method(*args, **kwargs)
        reopen_fsdp_forward(model)
        return output

    setattr(model, name, step)
    register_fsdp_forward_method(model, name)


def shard_device(cpu_offload: bool, device: torch.device) -> torch.device:
    """Where a rank on `device` keeps its shards: the host under CPU offload (FSDP2 requires them there)."""
    return torch.device("cpu") if cpu_offload else device


def materialize_shards(model: nn.Module, device: torch.device, seed: int, roots: Iterable[nn.Module] = ()) -> int:
    """After `fully_shard` on a model built on the meta device: allocate each rank's shards on `device` and
    initialise them (sharded_init.py), one module's full weights at a time. Returns the parameters initialised.
    `roots`: FSDP's roots where they are not `model` (pipeline stages), whose sharded storage is re-pointed too."""
    from torch.distributed.tensor import DTensor

    meta = [p for p in model.parameters() if p.is_meta]
    # Through each FSDP root, so that FSDP re-points its padded shard storage at the new tensors; tensors that hold
    # values (loaded weights, PEFT's adapters, buffers) keep them, on `device`.
    for root in [*roots, model]:
        apply_to_tensors(root, lambda t: torch.empty_like(t, device=device) if t.is_meta else t.to(device))

    def shard_region(param: nn.Parameter) -> tuple[slice, ...] | None:
        return local_shard_region(param) if isinstance(param, DTensor) else None  # else: outside every FSDP unit

    def keep_local_shard(param: nn.Parameter, shard: torch.Tensor) -> None:
        (param.to_local() if isinstance(param, DTensor) else param.data).copy_(shard)

    return initialize_parameters(model, keep_local_shard, seed, params=meta, region=shard_region)
