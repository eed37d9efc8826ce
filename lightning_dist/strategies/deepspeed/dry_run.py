"""The dry run of DeepSpeed's ZeRO (stages 1-3, CPU and NVMe offload): the engine our DeepSpeed strategy makes,
from its resolved config, over torch's fake process group and on fake tensors, stepped twice as one rank.

DeepSpeed's own code runs: its partitioning, its flat buffers, its gradient buckets, its hooks and its step. What
a fake tensor cannot do is answered here: its values read as finite, non-overflowing numbers
(`_compat/fake_tensors.fake_scalars`), its parameters are converted in place (`fake_parameters_converted_in_place`),
checks that ranks agree are skipped (nothing arrives over the fake group), and a native op cannot step it: an
offloaded optimizer steps with torch's AdamW in place of DeepSpeed's CPU Adam (the same state), and NVMe offload
is traced as host offload (nothing is written; the plan says what NVMe holds).

Categories, for the table: what ZeRO keeps between steps is found where DeepSpeed keeps it (each parameter's ZeRO-3
partition, ZeRO-3's gradient partitions, the fp32 master weights and the optimizer's moments); every other tensor
alive when the tracked step starts is one of DeepSpeed's buffers; the rest is what the tracker sees made in the
step (gathered parameters, gradients, activations, temporaries).
"""

from __future__ import annotations

import gc
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
from torch import nn

from lightning_dist._compat.deepspeed import (
    after_bucket_setup,
    after_each_gather,
    over_a_fake_process_group,
    zero3_gradient_partitions,
    zero3_partitions,
    zero3_persistent,
    zero3_whole_shape,
)
from lightning_dist._compat.fake_tensors import (
    fake_parameters_converted_in_place,
    fake_pinned_memory,
    fake_process_group,
    fake_scalars,
    fake_tensors,
    memory_categories,
    storage_categorized_tracker,
    tensors_from_data_made_on_the_host,
)
from lightning_dist._compat.lightning import deepspeed_engine, training_step_in_wrapper
from lightning_dist._compat.torch import tree_map
from lightning_dist.dry_run.optimizer import configured_optimizer
from lightning_dist.dry_run.ranks import RankView, Shard, as_rank, shards_of
from lightning_dist.memory.attention_kernel import fused_attention
from lightning_dist.parallel.device_check import OneDevicePerRank, collective_devices
from lightning_dist.parallel.devices import process_group_backend
from lightning_dist.parallel.sharded_init import parameters_on_meta
from lightning_dist.strategies.deepspeed.config.for_run import config_in_effect
from lightning_dist.strategies.deepspeed.engine import use_deepspeed_accelerator
from lightning_dist.strategies.deepspeed.zero3_runtime import prepare_zero3_runtime

# What torch says about DeepSpeed's code on fake tensors, once per call site: it checks a partition's alignment by
# its data pointer (fake tensors have none), and calls collectives by names torch deprecates.
FAKE_RUN_WARNINGS = (r"Accessing the data pointer of FakeTensor is deprecated",
                     r"`torch\.distributed\.\w+` is deprecated")


# The plan's categories beside this replay's tracker categories (ZeRO's engine buffers and step temporaries too).
ZERO_PLANNED_AS = {"SHARDED_PARAM": "parameters", "PARAM": "parameters", "SHARDED_GRAD": "gradients",
                   "GRAD": "gradients", "OPT": "optimizer_state", "UNSHARDED_PARAM": "gathered_parameters",
                   "ENGINE_BUFFERS": "gradient_bucket", "TEMP": "optimizer_step", "BUFFER": "buffers",
                   "ACT": "activations"}

def tracker_categories(parameters_sharded: bool) -> dict[str, str]:
    """The tracker's categories for a ZeRO engine: its own (values as torch's tracker names them), renamed where
    ZeRO means something else by them, and ZeRO-3's partitions, found where DeepSpeed keeps them."""
    return {
        "UNSHARDED_PARAM" if parameters_sharded else "PARAM": "Parameter",  # ZeRO-3: gathered for a block's use
        "UNSHARDED_GRAD" if parameters_sharded else "GRAD": "Gradient",  # whole, until reduced into partitions
        "BUFFER": "Buffer", "ACT": "Activation", "TEMP": "Temp", "OPT": "Optstate",
        "ENGINE_BUFFERS": "Other",  # ZeRO-1/2's gradient buckets, and what else is alive when the step starts
        **({"SHARDED_PARAM": "Sharded Param", "SHARDED_GRAD": "Sharded Grad"} if parameters_sharded else {}),
    }


def dry_run_config(config: dict[str, Any]) -> dict[str, Any]:
    """The resolved config as a dry run can run it: NVMe offload as host offload (no files written), and torch's
    optimizer allowed on the host (DeepSpeed's CPU Adam is a native op, which cannot step fake tensors)."""
    zero = dict(config.get("zero_optimization") or {})
    for section in ("offload_optimizer", "offload_param"):
        if (zero.get(section) or {}).get("device") == "nvme":
            zero[section] = {**zero[section], "device": "cpu"}
    return {**config, "zero_optimization": zero, "zero_force_ds_cpu_optimizer": False}


def resolved_config(strategy: Any, module: nn.Module, batch: Any, precision: str) -> dict[str, Any]:
    """The config the strategy resolves in `setup`, from what a dry run knows of the Trainer: its precision, one
    batch per step of `batch`'s size, no clipping."""
    trainer = SimpleNamespace(strategy=strategy, precision=precision, accumulate_grad_batches=1, max_steps=-1,
                              gradient_clip_val=None, gradient_clip_algorithm=None)
    tensors: list[torch.Tensor] = []
    tree_map(lambda t: tensors.append(t) if isinstance(t, torch.Tensor) else None, batch)
    loader = SimpleNamespace(batch_size=tensors[0].shape[0] if tensors else None)
    resolution = strategy.resolution(trainer, module, loader, in_rank=False)  # ValueError on a contradiction
    return config_in_effect(resolution, os.getcwd(), write=False)


def deepspeed_rank(strategy: Any, build: Callable[[], nn.Module], batch: Any, precision: str, world: int,
                   rank: int, device_type: str) -> tuple[nn.Module, dict[str, dict[str, int]], dict[str, int]]:
    """Rank `rank` of `world` (the strategy's cluster environment says so already) set up and stepped twice on
    fake `device_type` devices: (the module, with its ZeRO parameters; the second step's peak by device and
    category; the rank's coordinates in the strategy's mesh)."""
    from lightning_dist.strategies.deepspeed.precision import FrozenWeightsAsLoaded

    root = strategy.root_device
    device = root if device_type == "cuda" else torch.device("cpu")  # DeepSpeed names the host "cpu", unindexed
    strategy.precision_plugin = FrozenWeightsAsLoaded(precision)  # type: ignore[arg-type]  # checked before the run
    with parameters_on_meta():
        module = strategy.precision_plugin.convert_module(build())  # as the run converts it, on meta
    config = strategy.config = dry_run_config(resolved_config(strategy, module, batch, precision))
    stage = int(config["zero_optimization"].get("stage", 0))
    backend = process_group_backend(root, host_state=strategy.zero.offloads_to_host)
    local = {"LOCAL_RANK": str(strategy.local_rank), "RANK": str(rank), "WORLD_SIZE": str(world)}
    with ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        for message in FAKE_RUN_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
        stack.enter_context(mock.patch.dict(os.environ, local))
        stack.enter_context(fake_process_group(rank, world))
        stack.enter_context(over_a_fake_process_group())
        use_deepspeed_accelerator(root)
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend)
        if device_type == "cuda":
            torch.cuda.set_device(root)
        mesh = strategy.parallel_dims.build_mesh(device_type)
        mode = stack.enter_context(fake_tensors())
        for context in (fake_pinned_memory(), fake_scalars(), fake_parameters_converted_in_place(),
                        tensors_from_data_made_on_the_host()):
            stack.enter_context(context)
        module.to_empty(device=device)
        strategy.blocks.apply(module)
        if stage >= 3:
            prepare_zero3_runtime(config)
        optimizer = configured_optimizer(module)
        engine, zero_optimizer = deepspeed_engine(strategy, module, optimizer)
        stack.enter_context(OneDevicePerRank(rank, collective_devices(backend, device)))
        stack.enter_context(fused_attention())
        stack.enter_context(mock.patch.object(type(module), "log", lambda *a, **k: None, create=True))
        batch = tree_map(lambda t: torch.empty_like(t, device=device) if isinstance(t, torch.Tensor) else t, batch)
        step = partial(_step, strategy, engine, module, batch)
        step()  # the optimizer's state, DeepSpeed's buckets and ZeRO-3's trace of the step are made here
        tracker = _tracker(module, zero_optimizer, mode, parameters_sharded=stage >= 3)
        with (tracker, after_each_gather(partial(_gathered, tracker)),
              after_bucket_setup(partial(tracker.categorize, "ENGINE_BUFFERS"))):
            step()
        return module, memory_categories(tracker), dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))


def _step(strategy: Any, engine: Any, module: nn.Module, batch: Any) -> None:
    """A training step as our DeepSpeed strategy runs it: `training_step` inside the engine's forward, the
    engine's backward (the loss not divided again by accumulation: DeepSpeedStrategy.backward) and step."""
    with strategy.precision_plugin.train_step_context():
        loss = training_step_in_wrapper(strategy, engine, module, batch, 0)
    loss = loss["loss"] if isinstance(loss, dict) else loss
    engine.backward(loss, scale_wrt_gas=False)
    engine.step()


def _gathered(tracker: Any, module: nn.Module) -> None:
    """ZeRO-3 has gathered `module`'s parameters: their storage is gathered parameters, or, for those it keeps
    whole between steps, kept parameters. The tracker, whose hooks run before DeepSpeed's, would count it as the
    activations or temporaries the gather was made among."""
    persistent = zero3_persistent(module, recurse=False)
    tracker.categorize("SHARDED_PARAM", persistent)
    gathered = [p for p in module.parameters(recurse=False) if not any(p is q for q in persistent)]
    tracker.categorize("UNSHARDED_PARAM", gathered, fixed_for_good=False)


def _tracker(module: nn.Module, zero_optimizer: Any, mode: Any, parameters_sharded: bool) -> Any:
    """The memory tracker for the second step, told what already exists: ZeRO's partitions and optimizer state
    by where DeepSpeed keeps them (first found, first kept), then every other fake tensor of this run."""
    tracker = storage_categorized_tracker(tracker_categories(parameters_sharded), module)
    inner = zero_optimizer.optimizer  # the torch optimizer ZeRO steps on its flat fp32 partitions
    if parameters_sharded:  # ZeRO-3's parameters between uses: each one's partition, and the small ones it keeps
        tracker.categorize("SHARDED_PARAM", zero3_partitions(module) + zero3_persistent(module))
        tracker.categorize("SHARDED_GRAD", zero3_gradient_partitions(zero_optimizer))
    # The fp32 master partitions, by which the optimizer keeps their state (ZeRO-3 takes them out of its param
    # groups between steps), and the moments.
    masters = list(inner.state)
    moments = [t for state in inner.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    tracker.categorize("OPT", masters + moments)
    if not parameters_sharded:
        tracker.categorize("PARAM", list(module.parameters()))
    alive = [t for t in gc.get_objects() if isinstance(t, torch.Tensor) and getattr(t, "fake_mode", None) is mode]
    tracker.track_external(*alive)
    return tracker


@contextmanager
def loop_on_fake_tensors(strategy: Any) -> Iterator[None]:
    """Lightning's loop over DeepSpeed on fake tensors (fake_loop.py): collectives over torch's fake process group;
    the resolved config as a dry run runs it (NVMe traced as host offload, torch's optimizer allowed on the host),
    and the module's own optimizer kept under offload, where DeepSpeed's CPU Adam (a native op) would step it: no
    native op is built or loaded (the preflight's build of them is the real run's)."""
    from lightning_dist.strategies.deepspeed.config import preflight

    effective_config = strategy.effective_config
    with (over_a_fake_process_group(),
          mock.patch.object(strategy, "effective_config", lambda *args: dry_run_config(effective_config(*args))),
          mock.patch.object(strategy, "optimizer_for_offload", lambda optimizer, scheduler_config: optimizer),
          mock.patch.object(preflight, "native_ops_needed", lambda config: [])):
        yield


def rank_view(strategy: Any, build: Callable[[], nn.Module], batch: Any, precision: str, devices: int,
                        num_nodes: int, rank: int, device_type: str) -> RankView:
    """One rank of DeepSpeed's ZeRO, as the dry run reports it (dry_run/ranks.py)."""
    as_rank(strategy, rank, devices, num_nodes, device_type)
    world = devices * num_nodes
    module, by_device, coordinate = deepspeed_rank(strategy, build, batch, precision, world, rank, device_type)
    peak = next(categories for device, categories in by_device.items() if device.startswith(device_type))
    host = by_device.get("cpu", {}).get("Total", 0) if device_type != "cpu" else 0
    shards = shards_of(module, strategy.blocks.classes_in(module), _zero3_row)
    return RankView(rank, coordinate, shards, peak, host, ZERO_PLANNED_AS)


def _zero3_row(name: str, parameter: torch.nn.Parameter) -> Shard | None:
    """A ZeRO-3 parameter's row: its whole shape, and this rank's slice of the flattened parameter."""
    if (partitioned := zero3_whole_shape(parameter)) is None:
        return None
    whole, local, persistent = partitioned
    return name, whole, local, "flat partition, and whole (persistent)" if persistent else "flat partition"
