"""A launcher that checks a run on the launching process before any rank starts, launches as before, and ends the
ranks it started when its own rank stops early. In Jupyter, the ranks are forked from the kernel instead."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_dist._compat.lightning import (
    Launcher,
    MultiProcessingLauncher,
    SubprocessScriptLauncher,
    TunerExit,
    WorkerOutput,
    end_job_as_its_failed_rank,
)
from lightning_dist.lifecycle.error_line import say_error
from lightning_dist.lifecycle.peer_exits import first_failed, first_stopped, rank_ended, ranks_on_this_node
from lightning_dist.lifecycle.stop_signals import end_now, passing_signals_to, stopped

# How long the ranks this process started get to leave on their own after it stopped early: they see the same
# error, preemption or NaN at the same step and exit within seconds unless stuck. What they must finish (a save, the
# agreement to stop) is a collective this process finished too, so the time is only for them to leave quietly.
CHILD_EXIT_GRACE_S = 5


def end_as_failed_rank(processes: list) -> None:
    """A rank this process started failed first (`processes`, local ranks 1, 2, ...; the failed one has a non-zero
    return code): the others are killed, the job says which rank, how it ended and on which host, and ends with its
    exit code (128 + N for a rank killed by signal N, as a shell says); or, when this process was told to stop and
    passed the signal on, as the stop (75, 130)."""
    failed = first_failed(processes)
    assert failed is not None  # the observer calls this once a rank has failed
    index, returncode = failed
    rank = getattr(rank_zero_only, "rank", 0)  # this process's global rank, as Lightning set it
    said = rank_ended(rank + 1 + index, returncode, processes[index].pid)
    # A rank that gave up waiting for a stopped one failed first; the stopped one is the cause (asked before it is
    # killed below).
    said = first_stopped(ranks_on_this_node(processes, rank, 0)) or said
    for process in processes:
        if process.poll() is None:
            process.kill()
    if (stop := stopped()) is not None:
        end_now(stop.signum)
    say_error(f"{said}; the job's other ranks were stopped with it")
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(returncode if returncode > 0 else 128 - returncode)


def end_processes(processes: list, grace_s: float = CHILD_EXIT_GRACE_S) -> None:
    """Wait up to `grace_s` for `processes` (started by script or forked) to exit, then SIGKILL the rest (SIGTERM
    cannot stop a rank blocked in a collective)."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        remaining = max(0.0, deadline - time.monotonic())
        if isinstance(process, subprocess.Popen):
            try:
                process.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            continue
        process.join(remaining)
        if process.is_alive():
            process.kill()
            process.join()


def guarded(strategy: Any, launcher: Launcher | None, preflight: Callable | None = None) -> Launcher | None:
    """`launcher` wrapped in a GuardedLauncher; in an interactive session, ranks forked from it instead of the
    script re-run that Lightning's launcher would do (in Jupyter the "script" is the kernel)."""
    if launcher is None:
        return None
    if isinstance(launcher, SubprocessScriptLauncher) and in_interactive_session():
        launcher = ForkedRanks(strategy)
    return GuardedLauncher(launcher, preflight)


def in_interactive_session() -> bool:
    """Jupyter, IPython or `python -i`: Lightning's own test, read now rather than when Lightning was imported."""
    return hasattr(sys, "ps1") or bool(sys.flags.interactive)


class ForkedRanks(MultiProcessingLauncher):
    """Every preset's ranks, forked from a notebook's kernel (Lightning offers only `ddp_notebook` there).

    Constraints, as for Lightning's `ddp_notebook`: nothing may have touched CUDA in the kernel before `fit`
    (a forked process cannot use the parent's CUDA context); one `fit` per Trainer; one CPU thread per rank. The
    trained weights stay with the ranks (a sharded model's would have to be gathered first): read them from the run's
    checkpoint. What the kernel gets back is the Trainer's state and `callback_metrics`. A rank that fails ends the
    others, and its traceback is raised in the cell.
    """

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy, start_method="fork")

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        # GNU OpenMP's threads do not survive a fork: a rank that starts a parallel region on the pool the kernel
        # already used waits for them forever. One intra-op thread per rank (what Lightning picks anyway when the
        # ranks fill the cores); on a GPU the work is not on these threads.
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"  # Lightning's own thread setting then leaves it alone
        super()._wrapping_function(*args, **kwargs)

    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> WorkerOutput | None:
        if self._strategy.local_rank != 0:
            return None
        checkpoint = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint, "best_model_path", None) if checkpoint else None
        return WorkerOutput(best_model_path, None, trainer.state, results, self.get_extra_results(trainer))


class PreflightError(ValueError):
    """A run that cannot start, found before any rank was spawned; the message names what to change."""


def preflight(trainer: Any, **fit_arguments: Any) -> None:
    """Run the strategy's pre-launch checks now, with `trainer.fit`'s arguments (`model`, `datamodule`, ...), rather
    than inside `fit`: a caller that says something about the run once it is accepted (train.py) says it only then.
    Raises PreflightError; `fit` does not check again."""
    launcher = getattr(trainer.strategy, "launcher", None)
    if isinstance(launcher, GuardedLauncher):
        launcher.check(trainer, fit_arguments)


class GuardedLauncher(Launcher):
    """Wraps Lightning's launcher: `preflight(trainer, fit_arguments)`, if given, runs first when fitting (unless it
    ran already, through `check`), and the ranks it started end with this one when it stops early (`end_processes`).

    Lightning spawns the other ranks at the start of `trainer.fit`; a mistake found after that costs every rank
    its start-up and prints one traceback per rank, so the checks that need only the Trainer, the module and the
    data run here, once.
    """

    def __init__(self, launcher: Launcher, preflight: Callable[[Any, dict[str, Any]], None] | None = None) -> None:
        self.launcher = launcher
        self.preflight = preflight
        self.checked = False

    @property
    def is_interactive_compatible(self) -> bool:
        return self.launcher.is_interactive_compatible

    def check(self, trainer: Any, fit_arguments: dict[str, Any]) -> None:
        if self.preflight is not None:
            try:
                self.preflight(trainer, fit_arguments)
            except (ValueError, TypeError) as error:
                raise PreflightError(str(error)) from error
        self.checked = True

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if not self.checked and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self.check(trainer, inspect.signature(function).bind(*args, **kwargs).arguments)
        self.checked = False  # a later fit with this strategy is checked again
        end_job_as_its_failed_rank(end_as_failed_rank)
        try:
            # A signal that stops this process stops the ranks it starts; they end if it dies
            # (lifecycle/stop_signals.py).
            with passing_signals_to(lambda: getattr(self.launcher, "procs", [])):
                return self.launcher.launch(function, *args, trainer=trainer, **kwargs)
        except TunerExit:
            # How `Tuner.lr_find` ends its search fit, on every rank: each goes on with the script (they were
            # killed as stuck, 5 s later, and the user's next `trainer.fit` failed: "Connection closed by peer").
            raise
        except BaseException:
            # This rank's run ended early (an error, a timed-out collective, a preemption): the ranks it started
            # may be stuck in a collective that will never complete, or asleep, and would outlive the job.
            end_processes(getattr(self.launcher, "procs", []))
            raise

    def kill(self, signum: Any) -> None:
        self.launcher.kill(signum)

    def __getattr__(self, name: str) -> Any:  # e.g. `procs` of the subprocess launcher
        return getattr(self.launcher, name)
