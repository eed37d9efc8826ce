"""Lightning's whole loop as one rank of the world size you will launch, on fake devices: `Trainer.fit` (its sanity
validation, training steps and a validation, with the module's torchmetrics metrics and the run's callbacks),
`Trainer.test`, and the checkpoint fit would save, resumed by a new run for a step and a validation more.

A GPU run fails where a tensor meets one on another device; on CPU every device is the host, so no CPU run can show
it. Here CUDA is faked (`_compat/fake_cuda.py`) and every tensor is a fake one, with a device and no storage; torch's
fake process group completes every collective without sending anything. Every op and collective is device-checked
(`parallel/device_check.py`), and a failure inside a torchmetrics update names the metric. The two-step dry run
(`ranks.py`) drives a strategy's set-up and training steps by hand; this is Lightning's own loop, so what Lightning
and the module do around the steps runs too: moving the module and each batch, validation and test steps, metric
updates and their epoch-end compute, `self.log` and its reductions, the callbacks, and the checkpoint's contents.

What fake tensors cannot do is answered in the open, as in the dry run (each behind the fence): values read from
them are 1.0, 0 or False, a boolean mask selects every element, data loaders load real host batches; DeepSpeed's
offloaded optimizer steps with torch's AdamW (its CPU Adam is a native op) and NVMe offload is traced as host offload.
The checkpoint is written nowhere: its tensors are checked where they are, then given to the new run as
`torch.load(map_location="cpu")` would give them. A strategy that loads its state inside `load_checkpoint` from its
own files (FSDP's sharded directories, DeepSpeed's engine) keeps the state it set up: that load is the GPU suite's
(`tests/gpu`).
"""

from __future__ import annotations

import tempfile
import traceback
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import lightning as L
import torch
from torch import nn
from torchmetrics import Metric

from lightning_dist._compat.fake_tensors import (
    data_loaded_outside_fake_tensors,
    ddp_on_fake_tensors,
    fake_devices,
    fake_process_group,
    made_fake_in_place,
    object_collectives_kept_local,
    outside_fake_tensors,
)
from lightning_dist._compat.lightning import checkpoint_contents
from lightning_dist._compat.torch import tree_map
from lightning_dist.callbacks.finite_watch import FiniteWatch
from lightning_dist.dry_run.ranks import FakeRankEnvironment
from lightning_dist.memory.attention_kernel import fused_attention
from lightning_dist.parallel.device_check import DeviceMismatch, OneDevicePerRank, collective_devices
from lightning_dist.parallel.module_state import misplaced_module_state, same_device
from lightning_dist.parallel.sharded_init import parameters_on_meta

STEPS = 2  # fit's optimizer steps; its validation comes after the last, the resumed run's after one more


@dataclass
class LoopReport:
    """One rank's loop: what ran, what was logged, and where the state was at each point."""

    rank: int
    device: str
    stages: list[str] = field(default_factory=list)  # each loop as it started: "sanity check", "train", ...
    steps: int = 0  # optimizer steps, fit's and the resumed run's
    logged: list[str] = field(default_factory=list)  # the metrics the module and the callbacks logged
    misplaced: dict[str, list[str]] = field(default_factory=dict)  # by stage: buffers and metric states elsewhere
    saved: dict[str, list[str]] = field(default_factory=dict)  # the checkpoint's tensors by section: their devices
    resumed_from_step: int | None = None


@dataclass(frozen=True)
class _Run:
    """What a rank's run is made of, as train.py composes it (plain containers: they travel to the process with
    CUDA faked by pickle)."""

    strategy: dict
    module: dict
    data: dict
    callbacks: list[dict]
    precision: Any  # one of Lightning's precision names, as the config check let through
    devices: int
    num_nodes: int
    rank: int

    def trainer(self, report: LoopReport, directory: str, resuming: bool) -> tuple[L.Trainer, L.LightningModule, Any]:
        """A new Trainer, module and data module: fit's (2 steps, then a validation) or a resumed run's (1 step
        more, validated)."""
        from hydra.utils import instantiate

        build = partial(instantiate, _convert_="all")
        strategy = build(self.strategy)
        with parameters_on_meta() if strategy.initializes_shards else nullcontext():
            module = build(self.module)  # as train.py builds it for this strategy
        world = self.devices * self.num_nodes
        trainer = L.Trainer(
            accelerator="cuda",
            devices=self.devices,
            num_nodes=self.num_nodes,
            strategy=strategy,
            precision=self.precision,
            plugins=[FakeRankEnvironment(self.rank, self.devices, world)],
            default_root_dir=directory,
            max_steps=STEPS + 1 if resuming else STEPS,
            val_check_interval=1 if resuming else STEPS,
            check_val_every_n_epoch=None,
            limit_val_batches=1,
            limit_test_batches=1,
            num_sanity_val_steps=0 if resuming else 1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[*map(build, self.callbacks), StateAudit(report, take_checkpoint=not resuming)],
        )
        return trainer, module, build(self.data)


def loop_on_fake_devices(strategy_config: dict, module_config: dict, data_config: dict, callback_configs: list[dict],
                         precision: str, devices: int, num_nodes: int, rank: int) -> LoopReport:
    """Rank `rank` of `devices` x `num_nodes`, on fake `cuda` devices (CUDA real or faked: run it where
    `dry_run.dry_run_devices` says), from configurations as train.py composes them."""
    run = _Run(strategy_config, module_config, data_config, callback_configs, precision, devices, num_nodes, rank)
    report = LoopReport(rank, f"cuda:{rank % devices}")
    with tempfile.TemporaryDirectory(prefix="fake_loop_") as directory, ExitStack() as world:
        for context in (fake_process_group(rank, devices * num_nodes), object_collectives_kept_local(),
                        data_loaded_outside_fake_tensors(), ddp_on_fake_tensors(),
                        # The finite watch's verdict is read from values: fake ones read as 1.0 would be a record.
                        mock.patch.object(FiniteWatch, "describe", lambda watch, records, step: None)):
            world.enter_context(context)

        trainer, module, datamodule = run.trainer(report, directory, resuming=False)
        with _on_fake_devices(trainer.strategy, rank), _metric_named(module):
            trainer.fit(module, datamodule=datamodule)
            trainer.test(module, datamodule=datamodule)
        saved = next(c for c in trainer.callbacks if isinstance(c, StateAudit)).saved  # type: ignore[attr-defined]
        assert saved is not None, "fit saves a checkpoint after its validation"
        report.resumed_from_step = saved.get("global_step")

        trainer, module, datamodule = run.trainer(report, directory, resuming=True)
        setattr(trainer.strategy, "load_checkpoint", lambda path, weights_only=None: saved)  # read from memory
        in_memory = Path(directory, "in_memory.ckpt")  # a file for `fit` to be given (it checks that one is there)
        in_memory.touch()
        with _on_fake_devices(trainer.strategy, rank), _metric_named(module):
            trainer.fit(module, datamodule=datamodule, ckpt_path=in_memory)
    return report


class StateAudit(L.Callback):
    """Notes, as each loop starts, the module's buffers and metric states that are not on the rank's device and,
    while fitting, the optimizer state that is not where its parameter is; the steps taken and metrics logged; and
    takes the checkpoint a ModelCheckpoint would save after fit's validation (`saved`, as it would be loaded)."""

    def __init__(self, report: LoopReport, take_checkpoint: bool) -> None:
        self.report = report
        self.take_checkpoint = take_checkpoint
        self.saved: dict[str, Any] | None = None

    def _audit(self, trainer: L.Trainer, module: nn.Module, stage: str) -> None:
        self.report.stages.append(stage)
        found = misplaced_module_state(module, trainer.strategy.root_device)
        if stage != "test":  # the optimizers are fit's, put back on the host as it ended
            found += _misplaced_optimizer_state(trainer.optimizers)
        if found:
            self.report.misplaced[stage] = found

    def on_validation_end(self, trainer: L.Trainer, module: nn.Module) -> None:
        if trainer.sanity_checking or not self.take_checkpoint or self.saved is not None:
            return
        saved = checkpoint_contents(trainer)
        self.report.saved = _devices_by_section(saved)
        self.saved = tree_map(_as_loaded_on_the_host, saved)

    def on_sanity_check_start(self, trainer: L.Trainer, module: nn.Module) -> None:
        self._audit(trainer, module, "sanity check")

    def on_train_start(self, trainer: L.Trainer, module: nn.Module) -> None:
        self._audit(trainer, module, "train")

    def on_validation_start(self, trainer: L.Trainer, module: nn.Module) -> None:
        if not trainer.sanity_checking:
            self._audit(trainer, module, "validation")

    def on_test_start(self, trainer: L.Trainer, module: nn.Module) -> None:
        self._audit(trainer, module, "test")

    def on_train_end(self, trainer: L.Trainer, module: nn.Module) -> None:
        self.report.steps = trainer.global_step
        self.report.logged = sorted(set(self.report.logged) | set(trainer.callback_metrics))

    def on_test_end(self, trainer: L.Trainer, module: nn.Module) -> None:
        self.report.logged = sorted(set(self.report.logged) | set(trainer.callback_metrics))


def _misplaced_optimizer_state(optimizers: list[torch.optim.Optimizer]) -> list[str]:
    """Each optimizer state tensor on another device than its parameter (a scalar step count may be on the host:
    torch keeps it there unless the optimizer is capturable or fused)."""
    found = []
    for index, optimizer in enumerate(optimizers):
        for parameter, state in optimizer.state.items():
            for key, value in state.items():
                if not isinstance(value, torch.Tensor) or not isinstance(parameter, torch.Tensor):
                    continue
                if value.dim() == 0 and value.device.type == "cpu":
                    continue
                if not same_device(value.device, parameter.device):
                    found.append(f"optimizer {index}: {key} on {value.device}, its parameter on {parameter.device}")
                    break
    return found


def _devices_by_section(checkpoint: dict[str, Any]) -> dict[str, list[str]]:
    """Each top-level section of a checkpoint that holds tensors: the devices they are on, sorted."""
    sections = {}
    for section, content in checkpoint.items():
        found: set[str] = set()
        tree_map(lambda value: found.add(str(value.device)) if isinstance(value, torch.Tensor) else None, content)
        if found:
            sections[section] = sorted(found)
    return sections


def _as_loaded_on_the_host(value: Any) -> Any:
    """A saved tensor as `torch.load(map_location="cpu")` gives it back: a copy on the host."""
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


@contextmanager
def _on_fake_devices(strategy: Any, rank: int) -> Iterator[None]:
    """From the strategy's set-up on (its process group and device meshes are made first, with real integers),
    every tensor is fake and every op device-checked; for DeepSpeed, what fake tensors cannot run is replaced."""
    with ExitStack() as stack:
        stack.enter_context(strategy.dry_run_patches())
        set_up_environment = strategy.setup_environment

        def setup_environment() -> None:
            with outside_fake_tensors():  # again for `test`: its process groups and meshes from real integers
                set_up_environment()
            if not stack_entered:
                made_fake_in_place(strategy.lightning_module, stack.enter_context(fake_devices()))
                stack.enter_context(fused_attention())  # the kernel a device runs (CUDA builds ask cuDNN otherwise)
                root = strategy.root_device
                backend = strategy.process_group_backend or "nccl"
                stack.enter_context(OneDevicePerRank(rank, collective_devices(backend, root)))
                stack_entered.append(True)

        stack_entered: list[bool] = []
        strategy.setup_environment = setup_environment
        yield


@contextmanager
def _metric_named(module: nn.Module) -> Iterator[None]:
    """A device mismatch inside a torchmetrics metric's update or compute names the metric and where its state is."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - torchmetrics wraps what its update raised in a RuntimeError
        mismatch = _device_mismatch_in(error)
        if mismatch is None:
            raise
        metric = _metric_in_traceback(error)
        names = {id(submodule): name for name, submodule in module.named_modules()}
        if metric is None or id(metric) not in names:
            raise mismatch from error
        states = ", ".join(
            f"{state} on {getattr(metric, state).device}"
            for state in metric.metric_state
            if isinstance(getattr(metric, state), torch.Tensor)
        )
        raise DeviceMismatch(
            f"{mismatch} (in the metric {names[id(metric)]}, a {type(metric).__name__}: {states})"
        ) from error


def _device_mismatch_in(error: BaseException | None) -> DeviceMismatch | None:
    while error is not None:
        if isinstance(error, DeviceMismatch):
            return error
        error = error.__cause__ or error.__context__
    return None


def _metric_in_traceback(error: BaseException | None) -> Metric | None:
    """The innermost torchmetrics metric whose method raised (or called what raised) `error` or its causes."""
    found = None
    while error is not None:
        for frame, _ in traceback.walk_tb(error.__traceback__):
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Metric):
                found = candidate
        error = error.__cause__ or error.__context__
    return found
