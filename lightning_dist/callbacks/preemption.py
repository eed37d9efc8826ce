"""A notice that the job is about to be killed becomes a checkpoint of the step in progress, a SLURM requeue and an
exit code that says "resume me".

Schedulers warn before they kill: SLURM sends SIGTERM (or the signal of `--signal`, e.g. USR1 or submitit's USR2)
some seconds before SIGKILL. Lightning's own handlers act inside the signal handler, at whatever point the rank
happened to be, and each rank on its own: a collective there (its SIGTERM broadcast, its SLURM checkpoint) can pair
with another rank's gradient all-reduce. Here the handler only notes the signal; at the end of a step the loggers
write (every `log_every_n_steps`, or `check_every_n_steps`), all ranks agree (one tiny all-reduce: any rank told
means all stop), save together, and leave together. The agreement is read on the host, so it waits for the device:
at a logging step it waits anyway; every step, it would keep a GPU's host from running ahead.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_dist._compat.lightning import broadcast_sigterm_at_logging_steps, log_this_batch_now

log = logging.getLogger(__name__)

# sysexits.h EX_TEMPFAIL: not finished, try again. `resume=true` continues from the checkpoint just written.
PREEMPTED_EXIT_CODE = 75


class Preempted(SIGTERMException):
    """The run stopped for a preemption notice after saving its checkpoint. A SystemExit: where nothing catches it,
    the process exits with `code` (PREEMPTED_EXIT_CODE)."""

    def __init__(self, message: str, code: int = PREEMPTED_EXIT_CODE) -> None:
        super().__init__(code)
        self.message = message

    def __str__(self) -> str:
        return self.message


class Preemption(L.Callback):
    """On any of `signals`, finish the step, save `last`, requeue under SLURM (`requeue`), exit with code 75.

    check_every_n_steps: how often the ranks compare notes; default: the trainer's `log_every_n_steps`. The job
        stops within that many steps of the notice: choose it so that they fit in the scheduler's warning.
    """

    def __init__(self, signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1", "SIGUSR2"), requeue: bool = True,
                 check_every_n_steps: int | None = None) -> None:
        if check_every_n_steps is not None and check_every_n_steps < 1:
            raise ValueError(
                f"callbacks.preemption.check_every_n_steps: {check_every_n_steps} is not a positive number of steps;"
                " choose 1 or more, or null"
            )
        self.check_every_n_steps = check_every_n_steps
        unknown = [name for name in signals if not isinstance(getattr(signal, str(name), None), signal.Signals)]
        if unknown:
            raise ValueError(
                f"callbacks.preemption.signals: {', '.join(map(str, unknown))} is not a signal; e.g. SIGTERM, "
                "SIGUSR1, SIGUSR2"
            )
        self.signals = tuple(getattr(signal, name) for name in signals)
        self.requeue = requeue
        self.received: int | None = None

    def _note(self, signum: int, _frame: Any) -> None:
        # Only a flag: this runs between two bytecodes of whatever the rank was doing, collectives included.
        if self.received is not None:  # told twice (a rank that never reaches the step's end): die as asked
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.received = signum

    def _install(self) -> None:
        for signum in self.signals:
            signal.signal(signum, self._note)

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Lightning's own SIGTERM agreement, a read every step on every rank, is needed only at the steps it can act.
        broadcast_sigterm_at_logging_steps(trainer)

    # Lightning installs its own handlers after `on_fit_start`; these hooks come after that, and before any step.
    @override
    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install()

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install()

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if not self._agreed(trainer):
            return
        # This step's row first: the run stops in this hook, before the loop would log it, and the resumed run starts
        # after this step (its metrics.csv would lack the row).
        log_this_batch_now(trainer)
        path = self._save(trainer)
        signame = signal.Signals(self.received).name if self.received else "a signal on another rank"
        message = f"preempted ({signame}) at global step {trainer.global_step}: saved {path}; continue with resume=true"
        log.warning(message)
        if trainer.is_global_zero and self.requeue and os.environ.get("SLURM_JOB_ID"):
            _requeue_slurm_job()
        # Lightning's launcher watches the ranks it started and kills the whole job when one exits non-zero: those
        # leave quietly and rank 0 speaks for the job. Ranks a scheduler started each report the preemption.
        environment = getattr(trainer.strategy, "cluster_environment", None)
        launched_here = isinstance(environment, LightningEnvironment) and trainer.global_rank > 0
        raise Preempted(message, code=0 if launched_here else PREEMPTED_EXIT_CODE)

    def _agreed(self, trainer: L.Trainer) -> bool:
        told = self.received is not None
        if trainer.world_size == 1 or not dist.is_initialized():
            return told
        every = self.check_every_n_steps or trainer.log_every_n_steps or 1  # type: ignore[attr-defined]
        if trainer.global_step % every:  # the same steps on every rank: a collective all of them take part in
            return False
        flag = torch.tensor([int(told)], device=trainer.strategy.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _save(self, trainer: L.Trainer) -> str:
        checkpoint = trainer.checkpoint_callback
        if isinstance(checkpoint, ModelCheckpoint) and checkpoint.dirpath:
            path = checkpoint.format_checkpoint_name({}, checkpoint.CHECKPOINT_NAME_LAST)
        else:
            path = str(Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt")
        trainer.save_checkpoint(path)  # every rank: sharded strategies save together
        wait_for_checkpoints = getattr(trainer.strategy, "wait_for_checkpoints", None)
        if wait_for_checkpoints is not None:  # checkpoint.async: the job ends next, so the write must be done first
            wait_for_checkpoints()
        if isinstance(checkpoint, ModelCheckpoint):
            checkpoint.last_model_path = path
        return path


def _requeue_slurm_job() -> None:
    """`scontrol requeue` this job (or array task): SLURM starts it again with the same command."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    except FileNotFoundError:
        log.warning(f"cannot requeue SLURM job {job}: no scontrol on this node's PATH")
        return
    if result.returncode:
        log.warning(f"scontrol requeue {job} failed ({result.returncode}): {result.stderr.strip()}")
    else:
        log.warning(f"requeued SLURM job {job}")
