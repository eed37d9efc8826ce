"""The job `python train.py` runs (lightning_dist/run/cli.py calls it): a training run, a memory plan, a dry run,
or a sweep job in a process of its own; and how each ends: one line and an exit code for a refused or failed run,
the run directory of a refused one discarded, a sweep's failed trial recorded."""

from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from lightning_dist._compat.hydra import is_a_rank_lightning_started
from lightning_dist.callbacks import NonFiniteError, Preempted
from lightning_dist.callbacks.monitored_metrics import MetricNotLogged
from lightning_dist.checkpoints.swap import SaveFailed
from lightning_dist.lifecycle.collective_timeout import CollectiveFailure, PeerExited
from lightning_dist.lifecycle.exits import exit_code, exit_with, undo_on_refusal
from lightning_dist.lifecycle.job_store import RefusedElsewhere
from lightning_dist.reports.console import is_rank_zero, quiet_console
from lightning_dist.run.config_check import ConfigError
from lightning_dist.run.isolated_job import JobFailed, needs_isolation, run_isolated
from lightning_dist.run.resume import NothingLeftToTrain
from lightning_dist.run.run_dir import discard_refused_run, discard_this_run_of_the_job, release_claim
from lightning_dist.run.simulate import dry_run, plan
from lightning_dist.run.train import train

log = logging.getLogger(__name__)


def run_job(cfg: DictConfig) -> Any:
    """The job `python train.py` runs: a training run, a memory plan, or a sweep job in a process of its own.
    Returns the final metrics, or the one Hydra's optimizing sweepers minimise (`optimized_metric`)."""
    quiet_console()
    if cfg.trainer.accelerator == "cpu":  # said, so DeepSpeed need not detect it (and warn on every rank it did)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    hydra_config = HydraConfig.get()
    multirun = hydra_config.mode == RunMode.MULTIRUN
    undo_on_refusal(discard_this_run_of_the_job)  # another rank refused the run while its process group formed
    try:
        # A plan and a dry run start no rank (a dry run plays its ranks in this process): in a sweep, each job is one.
        if cfg.get("plan"):
            plan(cfg)
            _leave_nothing(hydra_config, multirun)
            return {}
        elif cfg.get("dry_run"):
            dry_run(cfg)
            _leave_nothing(hydra_config, multirun)
            return {}
        elif needs_isolation(hydra_config, cfg.trainer):
            # A sweep job with ranks: run it as a single run in a process of its own
            # (lightning_dist/run/isolated_job.py).
            metrics = run_isolated(hydra_config)
        else:
            metrics = train(cfg)
            release_claim()
    except (ConfigError, RefusedElsewhere, NonFiniteError, MetricNotLogged, CollectiveFailure, JobFailed,
            SaveFailed) as error:
        if not multirun:
            if isinstance(error, (ConfigError, RefusedElsewhere)):
                discard_refused_run(Path(hydra_config.runtime.output_dir), hydra_config.job.name)
            if isinstance(error, PeerExited) and is_a_rank_lightning_started(hydra_config.job.name):
                # Another rank this one lost: the process that started both (rank 0's) knows which ended and how,
                # and says so; this rank's own line, the first to print, would name no cause.
                sys.exit(exit_code(error))
            if isinstance(error, (NonFiniteError, MetricNotLogged)) and is_a_rank_lightning_started(
                    hydra_config.job.name):
                # The ranks agree on a NaN stop (a collective) and log the same metrics' names, and rank 0 reports
                # either with the job's exit code. A non-zero exit here would have Lightning kill rank 0 first (exit
                # 137, read as out of memory). Not for errors a rank may meet alone: leaving quietly then would let
                # the others wait in a collective.
                sys.exit(0)
            exit_with(error, code=exit_code(error))
        if cfg.get("optimized_metric") is None:
            raise  # Hydra reports the failed job and runs the others
        log.error(f"{error}: this trial counts as failed")
        return math.nan  # an optimizing sweeper records a failed trial and goes on
    except NothingLeftToTrain as done:  # exit 0: a requeued job of a finished run has nothing to do, and did it
        if not multirun:
            discard_refused_run(Path(hydra_config.runtime.output_dir), hydra_config.job.name)
        if is_rank_zero():
            log.info(str(done))
        return _objective(cfg, done.summary.get("metrics") or {})
    except Preempted as preempted:  # saved; the exit code (75) tells a scheduler or script to run it again
        if preempted.code:
            print(str(preempted), file=sys.stderr)
        sys.exit(preempted.code)
    return _objective(cfg, metrics)


def _leave_nothing(hydra_config: Any, multirun: bool) -> None:
    """A plan or a dry run trains nothing and leaves nothing (Hydra's `.hydra/`, the job's log, the run's claim):
    the run it was for can then go into the same directory."""
    if not multirun:  # a sweep's job directories are the sweep's record
        discard_refused_run(Path(hydra_config.runtime.output_dir), hydra_config.job.name)


def _objective(cfg: DictConfig, metrics: dict[str, float]) -> Any:
    name = cfg.get("optimized_metric")
    if name is None:
        return metrics
    if name not in metrics:
        raise ConfigError(
            f"optimized_metric={name}: the run reported no such metric; it reported {', '.join(sorted(metrics))}"
        )
    return metrics[name]
