"""Callbacks that tests add with `+callbacks.NAME._target_=tests.probes.X`: they write what they saw to JSON."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import lightning as L


class DeepSpeedEngineConfigProbe(L.Callback):
    """The config the DeepSpeed engine parsed (not the dict it was given), as rank 0's engine sees it."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        engine = trainer.strategy.model
        config = engine._config
        seen = {
            "zero": config.zero_config.model_dump(mode="json", by_alias=True),
            "fp16": config.float16_config.model_dump(mode="json"),
            "bf16": config.bfloat16_config.model_dump(mode="json"),
            "train_micro_batch_size_per_gpu": config.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": config.gradient_accumulation_steps,
            "train_batch_size": config.train_batch_size,
            "gradient_clipping": config.gradient_clipping,
            "steps_per_print": config.steps_per_print,
            "wall_clock_breakdown": config.wall_clock_breakdown,
            "optimizer_name": config.optimizer_name,
            "optimizer_params": config.optimizer_params,
            "scheduler_name": config.scheduler_name,
            "scheduler_params": config.scheduler_params,
            "optimizer_class": type(engine.optimizer.optimizer).__name__,
            "optimizer_lr": [group["lr"] for group in engine.optimizer.optimizer.param_groups],
        }
        self.path.write_text(json.dumps(seen, indent=2, default=str))


class DirectoryProbe(L.Callback):
    """The files under `directory` (with sizes) after the first training step, seen by rank 0."""

    def __init__(self, directory: str, path: str) -> None:
        self.directory, self.path = Path(directory), Path(path)
        self.done = False

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if self.done or not trainer.is_global_zero:
            return
        self.done = True
        files = {str(p.relative_to(self.directory)): p.stat().st_size for p in self.directory.rglob("*") if p.is_file()}
        self.path.write_text(json.dumps(files, indent=2))


class CommandLineProbe(L.Callback):
    """Each rank's command line (the interpreter's own arguments, `sys.orig_argv`), process id, rendezvous port and
    output directory: `<dir>/cmdline_rank<N>.json`."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        cmdline = list(sys.orig_argv)
        record = {"cmdline": cmdline, "default_root_dir": str(trainer.default_root_dir), "global_rank": trainer.global_rank,
                  "pid": os.getpid(), "master_port": os.environ.get("MASTER_PORT")}
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / f"cmdline_rank{trainer.global_rank}.json").write_text(json.dumps(record))


class FailAtStartOnRank(L.Callback):
    """Raises while the run is being built on the process whose LOCAL_RANK is `rank`: a rank dying at start-up."""

    def __init__(self, rank: int) -> None:
        if os.environ.get("LOCAL_RANK", "0") == str(rank):
            raise RuntimeError(f"injected start-up failure on local rank {rank}")


class InjectNaN(L.Callback):
    """Makes `module`'s output NaN in the training step at `global_step`, on the rank whose global rank is `rank`."""

    def __init__(self, module: str, global_step: int, rank: int = 0) -> None:
        self.module, self.global_step, self.rank = module, global_step, rank

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        def poison(module, args, output):
            if pl_module.training and trainer.global_step == self.global_step and trainer.global_rank == self.rank:
                return output * float("nan")
            return output

        # Prepended, so that the monitor's own check of this module's output sees the NaN.
        pl_module.get_submodule(self.module).register_forward_hook(poison, prepend=True)


class Zero3TraceProbe(L.Callback):
    """Whether ZeRO-3's prefetch trace is complete after each step: `<dir>/zero3_trace_rank<N>.json`."""

    def __init__(self, directory: str) -> None:
        self.directory, self.complete = Path(directory), []

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        offload = trainer.strategy.deepspeed_engine.optimizer.parameter_offload
        self.complete.append(offload.get_param_coordinator().is_complete_trace())

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        (self.directory / f"zero3_trace_rank{trainer.global_rank}.json").write_text(json.dumps(self.complete))


class StepClock(L.Callback):
    """The global step of the training batch in progress (None outside one), for instruments outside the Trainer."""

    current: int | None = None

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        StepClock.current = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        StepClock.current = None


class CarelessGather(L.Callback):
    """RunSummary's old mistake, kept for the device-discipline instruments to catch: a count gathered as a tensor
    made without `device=`, which lands on the host (on a GPU rank, NCCL refuses it)."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import torch

        trainer.strategy.all_gather(torch.tensor(trainer.global_step))


class BatchProbe(L.Callback):
    """What each training batch really held, counted from the batch itself, and how long its step took by this
    callback's own clock: `<dir>/batches_rank<N>.json`, an independent count to check throughput figures against."""

    def __init__(self, directory: str) -> None:
        self.directory, self.batches = Path(directory), []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        import time

        inputs = batch[0]
        self.batches.append({"step": trainer.global_step, "samples": len(inputs), "tokens": inputs.numel(),
                             "start": time.perf_counter()})

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        import time

        self.batches[-1]["seconds"] = time.perf_counter() - self.batches[-1].pop("start")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        (self.directory / f"batches_rank{trainer.global_rank}.json").write_text(json.dumps(self.batches))


def read_batches(directory: Path) -> list[list[dict]]:
    """BatchProbe's records, one list per rank."""
    return [json.loads(p.read_text()) for p in sorted(Path(directory).glob("batches_rank*.json"))]


class SignalAtStep(L.Callback):
    """Sends `signal` to this process when the training batch of `global_step` starts, on global rank `rank`: the
    scheduler's preemption notice, arriving mid-step."""

    def __init__(self, global_step: int, signal: str = "SIGTERM", rank: int = 0) -> None:
        self.global_step, self.signal, self.rank = global_step, signal, rank

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        import signal

        if trainer.global_step == self.global_step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), getattr(signal, self.signal))


class ShardShapes(L.Callback):
    """Each rank's local shape of every parameter when training starts: `<directory>/shards_rank<N>.json`."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from torch.distributed.tensor import DTensor

        # ZeRO-3 leaves a placeholder in each parameter; its shape before partitioning is `ds_shape`.
        shapes = {name.replace("_checkpoint_wrapped_module.", ""):
                  list(getattr(p, "ds_shape", None) or (p.to_local() if isinstance(p, DTensor) else p).shape)
                  for name, p in pl_module.named_parameters()}
        Path(self.directory, f"shards_rank{trainer.global_rank}.json").write_text(json.dumps(shapes))


class FailAtStep(L.Callback):
    """Raises when the training batch of `global_step` starts, on global rank `rank` alone: a rank's own bug."""

    def __init__(self, global_step: int, rank: int = 1) -> None:
        self.global_step, self.rank = global_step, rank

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step == self.global_step and trainer.global_rank == self.rank:
            raise RuntimeError(f"injected failure at global step {self.global_step}")


class HoldBeforeSetUp(L.Callback):
    """On global rank `rank` (torchrun's RANK): writes its pid to `marker` and waits, as Hydra makes the callbacks,
    before Lightning forms the process group. A test that kills the node once `marker` appears kills it inside the
    set-up for certain: a kill timed by the other node's output landed after the group had formed on a loaded
    machine, three tries in a row."""

    def __init__(self, marker: str, rank: int = 1, seconds: float = 600) -> None:
        if int(os.environ.get("RANK", 0)) == rank:
            Path(marker).write_text(str(os.getpid()))
            time.sleep(seconds)


class SleepAtStep(L.Callback):
    """Rank `rank` stalls for `seconds` at the start of the training batch of `global_step`: a rank stuck mid-step
    while the others wait for it in the step's collectives."""

    def __init__(self, global_step: int, seconds: float, rank: int = 1) -> None:
        self.global_step, self.seconds, self.rank = global_step, seconds, rank

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        import time

        if trainer.global_step == self.global_step and trainer.global_rank == self.rank:
            time.sleep(self.seconds)


class KillDuringSave(L.Callback):
    """SIGKILLs every rank (each its own process group, at the same moment) `FAULT_KILL_DELAY_S` seconds after save
    number `FAULT_KILL_AT_SAVE` began, from a timer thread: a kill -9 that lands inside the save, however briefly the
    save lasts. Set by the fault loop through the environment (the command stays the same, so that `resume=true`
    recognises the runs as one); inert where unset. Every rank arms its own timer: ranks started by Lightning share
    the launching rank's group, ranks forked by the suite's warm interpreter each have their own."""

    def __init__(self) -> None:
        self.at_save = int(os.environ.get("FAULT_KILL_AT_SAVE", -1))
        self.delay_s = float(os.environ.get("FAULT_KILL_DELAY_S", 0))
        self.saves = 0

    def on_save_checkpoint(self, trainer: L.Trainer, *args) -> None:
        import signal
        import threading

        if self.saves == self.at_save:
            threading.Timer(self.delay_s, os.killpg, (os.getpgid(0), signal.SIGKILL)).start()
        self.saves += 1


class SlowExitOnRank(L.Callback):
    """Rank `rank` leaves `seconds` later after an error than the others: longer than Lightning's child-process
    observer (it polls every 5 s) takes to see how the ranks it started exited."""

    def __init__(self, rank: int = 0, seconds: float = 6.0) -> None:
        self.rank, self.seconds = rank, seconds

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if trainer.global_rank == self.rank:
            time.sleep(self.seconds)


class StopSwallowedThenFails(L.Callback):
    """SIGTERM arrives in code that swallows it (a library's catch-all around an import), which then fails with an
    error of its own: what a stop during a half-done import leaves (numpy's RecursionError, tests/test_stop_signals.py).
    `at`: "init" (while the callbacks are built, before any rank starts) or "fit_start"."""

    def __init__(self, at: str = "init") -> None:
        self.at = at
        if at == "init":
            self._swallow_a_stop_then_fail()

    def on_fit_start(self, *args) -> None:
        if self.at == "fit_start":
            self._swallow_a_stop_then_fail()

    @staticmethod
    def _swallow_a_stop_then_fail() -> None:
        import signal

        try:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(200):  # the handler raises `Stopped` between two of these
                time.sleep(0.01)
        except BaseException:  # noqa: BLE001 (the catch-all this stands for)
            pass
        raise RecursionError("maximum recursion depth exceeded while calling a Python object")



class TensorPeak(L.Callback):
    """Each rank's peak of live tensors over the training step `step` (the second: the optimizer state exists), by
    category, as torch's memory tracker follows a real step (the tracker the dry run replays pipeline stages
    under): `<directory>/tensor_peak_rank<N>.json`. Tensors made before the step and held by neither the model nor
    the optimizer are not seen."""

    def __init__(self, directory: str, step: int = 1) -> None:
        self.directory, self.step, self.tracker = directory, step, None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if trainer.global_step == self.step:
            from lightning_dist._compat.fake_tensors import pipeline_memory_tracker

            self.tracker = pipeline_memory_tracker(pl_module, trainer.optimizers[0])
            self.tracker.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if self.tracker is not None:
            from lightning_dist._compat.fake_tensors import memory_categories

            self.tracker.__exit__(None, None, None)
            peak = memory_categories(self.tracker)
            Path(self.directory, f"tensor_peak_rank{trainer.global_rank}.json").write_text(json.dumps(peak))
            self.tracker = None


class SwapParametersOnConversion(L.Callback):
    """Every `module.to()` of the run swaps each parameter for its moved copy (`torch.utils.swap_tensors`), as torch
    2.11 moves FSDP2's DTensor parameters whatever this flag says: a parameter something holds a weak reference to
    cannot be swapped ("Cannot swap t1 because it has weakref associated with it"), and `trainer.test` after
    `trainer.fit` moves the model again. On the torch of this venv, the check that torch 2.11 alone makes."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        import torch

        torch.__future__.set_swap_module_params_on_conversion(True)


class IdleExperts(L.Callback):
    """The experts each mixture-of-experts layer left uncalled in each training step on this rank (no token chose
    them), from the layers' `tokens_per_expert`: `<dir>/idle_experts_rank<N>.json`, [[step, layer, expert], ...]."""

    def __init__(self, directory: str) -> None:
        self.directory, self.idle = Path(directory), []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        for name, module in pl_module.named_modules():
            counts = getattr(module, "tokens_per_expert", None)
            if counts is not None:
                self.idle += [[trainer.global_step - 1, name, int(e)] for e in (counts == 0).nonzero().flatten()]

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        (self.directory / f"idle_experts_rank{trainer.global_rank}.json").write_text(json.dumps(self.idle))
