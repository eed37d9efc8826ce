"""Host synchronisations per training step, counted and attributed to the code that made them.

On a GPU the host queues kernels and runs ahead of the device; each read of a device value on the host (`.item()`,
`float(t)`, `bool(t)`, `.tolist()`, a copy to the host, an op whose output's size depends on the data) makes it wait
until the device has caught up, and the Python that runs after the read is then no longer hidden behind the device's
work. A training step that neither logs nor refreshes the progress bar should have none.

`HostSyncs` counts them with torch's dispatch (the reads, the copies and the data-dependent ops) and function
(`.tolist()`, `.numpy()`, which read a tensor's memory without dispatching) modes, by training step, naming for each
the first frame outside torch that asked for it. On a CPU every tensor is on the host, so copies to the host show
only on a device; the reads and the data-dependent ops count the same everywhere. Reads made while a DataLoader
makes a batch are not counted: batches are made on the host by design, and moved to the device after.

    python train.py 'callbacks=[default,host_syncs]'    # writes host_syncs.json into the run's directory
"""

from __future__ import annotations

import inspect
import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning as L
from torch.overrides import TorchFunctionMode
from typing_extensions import override

from lightning_dist._compat.lightning import logs_this_step, step_in_progress
from lightning_dist._compat.torch import TorchDispatchMode, host_sync_kind
from lightning_dist.callbacks.progress import refreshes_after

UNDISPATCHED_READS = frozenset({"tolist", "numpy"})
DATA_LOADING = "torch.utils.data."
# Where a sync is asked for: the first frame in none of these packages.
PASS_THROUGH = frozenset({"torch", __name__, "contextlib", "functools", "typing_extensions"})


@dataclass(frozen=True)
class Sync:
    step: int  # the optimizer step being run, from the fetch of its batch on; validation and saves after it count to it
    kind: str  # read, copy to host, data-dependent
    op: str
    source: str  # ours (lightning_dist.<package>), Lightning, DeepSpeed, torch, or the user's module
    where: str  # module:function:line of the frame that asked, then of its callers


@dataclass(frozen=True)
class StepEvents:
    """What a step did besides training, each of which reads values on the host by design."""

    logs: bool
    refreshes_bar: bool
    validates: bool = False
    saves: bool = False

    @property
    def quiet(self) -> bool:
        return not (self.logs or self.refreshes_bar or self.validates or self.saves)


class _Counter(TorchDispatchMode):
    def __init__(self, owner: HostSyncs) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = host_sync_kind(func, args, kwargs)
        if kind is not None:
            self.owner.record(kind, func)
        return func(*args, **kwargs)


class _UndispatchedReads(TorchFunctionMode):
    def __init__(self, owner: HostSyncs) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in UNDISPATCHED_READS:
            self.owner.record("read", func)
        return func(*args, **(kwargs or {}))


class HostSyncs(L.Callback):
    """Counts host synchronisations by training step while training runs; writes them to `path` (JSON; one file
    per rank, `_rank<N>` before the suffix on ranks other than 0) when training ends. `per_quiet_step()` is the
    count for steps that neither log, refresh the bar, validate nor save: 0 is the goal. `from_step`: count from
    that optimizer step on (counting slows every op: a benchmark times the steps before it)."""

    def __init__(self, path: str | None = None, from_step: int = 0) -> None:
        self.path = Path(path) if path else None
        self.from_step = from_step
        self.syncs: list[Sync] = []
        self.steps: dict[int, StepEvents] = {}
        self._trainer: L.Trainer | None = None
        self._modes: tuple[_Counter, _UndispatchedReads] | None = None

    def record(self, kind: str, func: Any) -> None:
        """One host synchronisation by `func`, seen by one of the modes while training is counted."""
        if self._trainer is None:
            return
        asked_by = _asked_by(inspect.currentframe())
        if asked_by is not None:
            step = step_in_progress(self._trainer)
            self.syncs.append(Sync(step, kind, str(getattr(func, "__name__", func)), *asked_by))

    def per_quiet_step(self) -> dict[int, list[Sync]]:
        """The syncs of every step that only trained (one entry per such step, empty when it had none)."""
        quiet: dict[int, list[Sync]] = {step: [] for step, events in self.steps.items() if events.quiet}
        for sync in self.syncs:
            if sync.step in quiet:
                quiet[sync.step].append(sync)
        return quiet

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.from_step <= step_in_progress(trainer):
            self._start(trainer)

    def _start(self, trainer: L.Trainer) -> None:
        self._trainer = trainer
        self._modes = (_Counter(self), _UndispatchedReads(self))
        for mode in self._modes:
            mode.__enter__()

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._modes is None and step_in_progress(trainer) >= self.from_step:
            self._start(trainer)  # this step's fetch is not counted: a DataLoader's reads are not anyway
        if self._modes is None:
            return
        events = StepEvents(logs=logs_this_step(trainer), refreshes_bar=refreshes_after(trainer, batch_idx))
        self.steps[step_in_progress(trainer)] = events

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._mark(validates=True)

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._mark(saves=True)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop()
        if self.path is not None:
            rank = trainer.global_rank
            path = self.path.with_stem(f"{self.path.stem}_rank{rank}") if rank else self.path
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.report(), indent=1))

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._stop()

    def report(self) -> dict[str, Any]:
        quiet = self.per_quiet_step()
        return {
            "quiet_steps": sorted(quiet),
            "syncs_in_quiet_steps": sum(len(syncs) for syncs in quiet.values()),
            "by_source_in_quiet_steps": dict(Counter(s.source for syncs in quiet.values() for s in syncs)),
            "steps": {str(step): asdict(events) for step, events in self.steps.items()},
            "syncs": [asdict(sync) for sync in self.syncs],
        }

    def _mark(self, **events: bool) -> None:
        step = step_in_progress(self._trainer) if self._trainer is not None else None
        if step in self.steps:
            self.steps[step] = StepEvents(**{**asdict(self.steps[step]), **events})

    def _stop(self) -> None:
        if self._modes is not None:
            for mode in reversed(self._modes):
                mode.__exit__(None, None, None)
            self._modes = None
        self._trainer = None


def _asked_by(frame: Any, depth: int = 5) -> tuple[str, str] | None:
    """The first frame outside torch (and this module), as a source, and where: it and its next callers. None for
    a read made while a DataLoader makes a batch: batches are made on the host, by design, and moved after."""
    chain: list[str] = []
    source = "torch"
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith(DATA_LOADING):
            return None
        if len(chain) < depth and module not in PASS_THROUGH and module.split(".")[0] not in PASS_THROUGH:
            if not chain:
                source = _source_of(module)
            chain.append(f"{module}:{frame.f_code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return source, " <- ".join(chain) or "?"


def _source_of(module: str) -> str:
    if module.startswith("lightning_dist."):
        return "ours (" + ".".join(module.split(".")[:2]) + ")"
    top = module.split(".")[0]
    return {"lightning": "Lightning", "deepspeed": "DeepSpeed"}.get(top, module)
