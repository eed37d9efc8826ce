"""The dry run's replay of DDP and FSDP2 (dry_run/ranks.py): one rank, set up by the strategy itself on the meta device
and fake tensors (FSDP: its mesh, tensor parallelism, activation checkpointing and FSDP2's sharding, then fake storage
for the shards; DDP: its wrapper), trained two steps under torch's memory trackers."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from typing import Any
from unittest import mock

import torch
from torch import nn

from lightning_dist._compat.fake_tensors import (
    ddp_on_fake_tensors,
    fake_pinned_memory,
    fake_process_group,
    fake_tensors,
    fsdp_memory_tracker,
    memory_categories,
    meshes_built_outside_fake_tensors,
    module_memory_tracker,
    pipeline_memory_tracker,
)
from lightning_dist._compat.lightning import training_step_in_wrapper, wrapped_by_strategy
from lightning_dist._compat.torch import tree_map
from lightning_dist.dry_run.optimizer import configured_optimizer
from lightning_dist.dry_run.ranks import RankView, as_rank, shards_of
from lightning_dist.memory.attention_kernel import fused_attention
from lightning_dist.parallel.context_parallel import ContextParallel
from lightning_dist.parallel.device_check import OneDevicePerRank, collective_devices
from lightning_dist.parallel.devices import process_group_backend
from lightning_dist.parallel.sharded_init import parameters_on_meta
from lightning_dist.strategies.torch.fully_shard import shard_device
from lightning_dist.strategies.torch.pipeline_replay import PipelineReplay, stage_boundary


def rank_view(strategy: Any, build: Callable[[], nn.Module], batch: Any, precision: str, devices: int,
              num_nodes: int, rank: int, device_type: str, sharded: bool) -> RankView:
    """One rank of DDP (`sharded=False`: the whole model on each rank, wrapped) or FSDP (`sharded`), with its
    pipeline stages if it has them (their schedule's order of actions: pipeline_replay.py)."""
    as_rank(strategy, rank, devices, num_nodes, device_type)
    strategy.precision_plugin = _precision_plugin(sharded, precision, device_type)
    root = strategy.root_device
    pipelined = sharded and strategy.parallel_dims.pp > 1
    coordinates = strategy.parallel_dims.coordinates(rank)
    if pipelined:
        strategy.forget_pipeline_stages()  # another rank's
    with fake_process_group(rank, devices * num_nodes):
        if device_type == "cuda":
            torch.cuda.set_device(root)  # as Lightning's CUDA accelerator does before anything is built
        mesh = strategy.build_device_mesh(device_type) if sharded else strategy.parallel_dims.build_mesh(device_type)
        with parameters_on_meta():
            module = build()
            boundary = _stage_boundary(strategy, build, batch, precision) if pipelined else None
        host_state = strategy.keeps_state_on_host
        with ExitStack() as stack:
            stack.enter_context(fake_tensors())
            stack.enter_context(meshes_built_outside_fake_tensors())
            stack.enter_context(fake_pinned_memory())
            model = _set_up(strategy, sharded, module, shard_device(host_state, root) if sharded else root, stack)
            backend = process_group_backend(root, host_state)
            stack.enter_context(OneDevicePerRank(rank, collective_devices(backend, root)))
            stack.enter_context(fused_attention())  # the kernel a device runs, not fake tensors' math path
            stack.enter_context(mock.patch.object(type(module), "log", lambda *a, **k: None, create=True))
            batch = tree_map(lambda t: torch.empty_like(t, device=root) if isinstance(t, torch.Tensor) else t, batch)
            optimizer = configured_optimizer(module)
            if pipelined:
                assert boundary is not None
                replay = PipelineReplay(strategy, module, strategy.pipeline_views, batch, *boundary)
                step = partial(replay.step, optimizer)
            elif sharded and strategy.parallel_dims.cp > 1:  # this rank's shard of each sequence, as training runs it
                context = strategy.context_axis(mesh, coordinates["cp"], root, module)
                step = partial(_step_in_context, context, strategy, model, module, optimizer, context.shard(batch))
            else:
                step = partial(_step, strategy, model, module, optimizer, batch)
            step()  # creates the optimizer state; its DTensor temporaries have global size
            if pipelined:  # torch's FSDP tracker follows one root, called once a step: stages are several, called often
                tracker = pipeline_memory_tracker(module, optimizer)
                tracker.track_external(*replay.buffers())
            elif sharded:
                tracker = fsdp_memory_tracker(model, optimizer)
                tracker.track_inputs((batch,))
            else:  # DDP's gradient buckets, made before the tracker: the gradients are views of them
                tracker = module_memory_tracker(model, optimizer)
                tracker.track_external(*(p.grad for p in module.parameters() if p.grad is not None))
            with tracker:
                step()
            by_device = memory_categories(tracker)
    peak = next(categories for device, categories in by_device.items() if device.startswith(root.type))
    host = by_device.get("cpu", {}).get("Total", 0) if root.type != "cpu" else 0
    coordinate = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    blocks = strategy.block_classes_of(module) if sharded else strategy.blocks.classes_in(module)
    if pipelined:
        return RankView(rank, coordinate, shards_of(module, blocks), peak, host, PIPELINE_PLANNED_AS)
    return RankView(rank, coordinate, shards_of(module, blocks), peak, host)


# A pipelined rank's categories (torch's general tracker): its receive buffers are the external tensors it is given.
# Gathered parameters are made in forward (ACT) or for backward (TEMP), the gradients accumulated unsharded in
# backward (TEMP).
PIPELINE_PLANNED_AS = {"PARAM": "parameters", "GRAD": "gradients", "OPT": "optimizer_state", "BUFFER": "buffers",
                       "ACT": "activations", "TEMP": "accumulated_gradients", "OTH": "pipeline_buffers"}


def _stage_boundary(strategy: Any, build: Callable[[], nn.Module], batch: Any, precision: str
                    ) -> tuple[torch.Size, torch.dtype]:
    """The shape of what a pipeline stage sends the next (a model built on meta runs its first stage) and the
    dtype it computes in."""
    whole = build()
    split = strategy.pipeline.split(whole, strategy.block_classes_of(whole), pp_rank=0)
    dtype = {"bf16": torch.bfloat16, "16": torch.float16}.get(precision.split("-")[0], torch.float32)
    return stage_boundary(whole, split.trunk, split.layout, batch), dtype


def _set_up(strategy: Any, sharded: bool, module: nn.Module, device: torch.device, stack: ExitStack) -> nn.Module:
    """The strategy's own set-up of `module` (built on meta), in fake mode: FSDP (`sharded`) shards it there, then
    its shards get fake storage on `device` (the host under CPU offload); DDP wraps the whole model once it is on
    `device`. Returns what the step runs: the module, or its wrapper."""
    if sharded:
        strategy.parallelize(module)  # FSDP2 makes empty tensors on the device as it wraps: in fake mode too
        module.to_empty(device=device)
        return module
    module.to_empty(device=device)
    stack.enter_context(ddp_on_fake_tensors())
    return wrapped_by_strategy(strategy, module)


def _precision_plugin(sharded: bool, precision: str, device_type: str) -> Any:
    """FSDP (`sharded`) reads the precision from its plugin (its mixed-precision policy); DDP runs under autocast."""
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision

    if not sharded and precision.endswith("-mixed"):
        return MixedPrecision(precision, device_type)  # type: ignore[arg-type]  # a mixed precision, as checked
    plugin = Precision()
    plugin.precision = precision  # type: ignore[assignment]  # one of Lightning's names, checked before the run
    return plugin


def _step_in_context(context: ContextParallel, strategy: Any, model: nn.Module, module: nn.Module,
                     optimizer: torch.optim.Optimizer, batch: Any) -> None:
    """A training step on this rank's shard of every sequence (`batch` is it), attention exchanged across the
    context-parallel ranks, as the strategy's step and backward run it."""
    with context.step(module):
        _step(strategy, model, module, optimizer, batch)


def _step(strategy: Any, model: nn.Module, module: nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> None:
    """One training step as Lightning runs it: gradients cleared, then forward through the wrapper (`model`) where
    there is one, so that its hooks run, under the precision plugin's context; backward; the optimizer's step."""
    optimizer.zero_grad()
    with strategy.precision_plugin.train_step_context():
        if model is not module:
            loss = training_step_in_wrapper(strategy, model, module, batch, 0)
        else:
            step = getattr(module, "training_step", None)
            loss = step(batch, 0) if step is not None else module(batch)
    loss = loss["loss"] if isinstance(loss, dict) else loss
    loss.backward()
    optimizer.step()
