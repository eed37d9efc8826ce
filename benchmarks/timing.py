"""Clocks for benchmarks, as callbacks `train.py` takes on the command line (`+callbacks.<name>._target_=...`)."""

from __future__ import annotations

import cProfile
import json
import time
from pathlib import Path

import lightning as L
import torch


class StepClock:
    """Marks the start of each iteration: the host's clock on a CPU; on a GPU a CUDA event recorded on the current
    stream, so that marking never waits for the device (a host clock there measures the host, which runs ahead until
    something reads a value). `intervals()`, the seconds between consecutive marks, reads the events at the end."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.marks: list = []

    def tick(self) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


class IterationTimer(L.Callback):
    """The start of one training batch to the start of the next, as `raw_loop.py` times (data loading, every hook
    and callback included; what follows the last batch, validation and saving, is not). On a GPU, by CUDA events."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.clock: StepClock | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.clock is None:
            self.clock = StepClock(trainer.strategy.root_device)
        self.clock.tick()

    def on_train_end(self, trainer, pl_module) -> None:
        iterations = self.clock.intervals() if self.clock is not None else []
        self.path.with_name(f"{self.path.stem}_rank{trainer.global_rank}.json").write_text(json.dumps(iterations))


def dynamo_counters() -> dict:
    """torch._dynamo's counters so far in this process: graphs compiled, graph breaks, frames compiled."""
    from torch._dynamo.utils import counters

    return {"unique_graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values()),
            "frames_ok": counters["frames"]["ok"]}


class DynamoCounters(L.Callback):
    """torch._dynamo's counters after each training step on rank 0 (graphs compiled, graph breaks, frames):
    `path`, a JSON list, written when training ends (benchmarks/raw_loop.py writes the same for the raw loop)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.steps.append(dynamo_counters())

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            self.path.write_text(json.dumps(self.steps))


class Milestones(L.Callback):
    """Rank 0's wall-clock times (`time.time()`, comparable with the launching shell's) of the moments a person
    waits for: setup done, the first training batch begun, the first optimizer step done."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.times: dict[str, float] = {}

    def on_fit_start(self, trainer, pl_module) -> None:
        self.times["setup_done"] = time.time()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.times.setdefault("first_batch", time.time())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if "first_step" not in self.times and trainer.global_step >= 1:
            self.times["first_step"] = time.time()
            if trainer.is_global_zero:
                self.path.write_text(json.dumps(self.times))


PROFILED_STEPS = range(10, 20)  # after warm-up; the same iterations on both sides


def profiler_table(profiler, path: Path) -> None:
    """What each side spent its CPU on, by operator (self time first): compared to find the framework's share."""
    averages = profiler.key_averages()
    path.write_text(averages.table(sort_by="self_cpu_time_total", row_limit=60, max_name_column_width=70))
    profiler.export_chrome_trace(str(path.with_suffix(".trace.json")))


class StepProfiler(L.Callback):
    """torch.profiler over `PROFILED_STEPS` on rank 0; the operator table goes to `path`, the trace beside it."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.profiler = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.is_global_zero and batch_idx == PROFILED_STEPS.start:
            import torch

            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=False)
            self.profiler.__enter__()
        elif self.profiler is not None and batch_idx == PROFILED_STEPS.stop:
            self.profiler.__exit__(None, None, None)
            profiler_table(self.profiler, self.path)
            self.profiler = None


def cprofile_path(path: Path, rank: int) -> Path:
    return path.with_name(f"{path.stem}_rank{rank}.prof")


class StepCProfile(L.Callback):
    """cProfile over `PROFILED_STEPS` on every rank, written to `<path>_rank<N>.prof`: where a rank's time goes
    between Python, operators and waiting (`benchmarks/time_split.py`; `raw_loop.py --cprofile` writes the same)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.profile: cProfile.Profile | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == PROFILED_STEPS.start:
            self.profile = cProfile.Profile()
            self.profile.enable()
        elif self.profile is not None and batch_idx == PROFILED_STEPS.stop:
            self.profile.disable()
            self.profile.dump_stats(cprofile_path(self.path, trainer.global_rank))
            self.profile = None
