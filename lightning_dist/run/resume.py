"""`resume=true`: which checkpoint a run starts from. The newest whole one of this command that holds this model's
weights, chosen by global rank 0 and shared with every rank, each one passed over named with why; a run that
trained to its end has nothing left to train."""

from __future__ import annotations

import json
import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import cast

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from lightning_dist.checkpoints.autoresume import (
    RESUME_OWN_DIR,
    finished_run,
    newest_complete_checkpoint,
    newest_whole_checkpoint_among,
    newest_whole_checkpoint_in,
)
from lightning_dist.checkpoints.contents import another_model, check_autoep_layout, saved_step, saved_weights_only
from lightning_dist.checkpoints.formats import CheckpointError
from lightning_dist.lifecycle.exits import FINISHED
from lightning_dist.lifecycle.job_store import shared_choice
from lightning_dist.reports.summary_file import SUMMARY_NAME, read_summary
from lightning_dist.run.run_dir import as_before_this_attempt

log = logging.getLogger(__name__)


class NothingLeftToTrain(Exception):
    """`resume=true` found the last save of a run that trained to its end: this run trains nothing, says so, and
    leaves no run directory behind (`summary`: that run's)."""

    exit_code = FINISHED

    def __init__(self, said: str, summary: dict) -> None:
        super().__init__(said)
        self.summary = summary


# Rank 0 decides what to resume from; the ranks it starts inherit the decision through the environment, so a
# checkpoint written meanwhile cannot make them disagree.
RESUME_ENV = "LIGHTNING_DIST_RESUME_FROM"


def checkpoint_to_resume(cfg: DictConfig, shapes: dict[str, tuple[int, ...]], autoep_size: int | None = None,
                         ) -> str | None:
    """`resume=true`: the newest whole checkpoint of this command that holds this model's weights (`shapes`; under
    DeepSpeed's AutoEP, `autoep_size` > 1, the names of its own layers; None: a strategy that reads DeepSpeed's
    checkpoints consolidated, contents.check_autoep_layout), each one passed over named with why; the
    user's own `ckpt_path` when given."""
    if cfg.get("ckpt_path") or not cfg.get("resume"):
        return cfg.get("ckpt_path")
    if RESUME_ENV in os.environ:
        return os.environ[RESUME_ENV] or None
    output_dir = Path(cfg.paths.output_dir)
    said = f"resume={'true' if cfg.resume is True else cfg.resume}: "
    passed: list[str] = []

    def passed_over(checkpoint: Path, why: str) -> None:
        passed.append(str(checkpoint))
        log.info(f"{said}passed over {checkpoint}: {why}")

    def another_models(checkpoint: Path) -> str | None:
        try:
            if saved_weights_only(checkpoint):
                return "it holds the model's weights only (saved with save_weights_only=True), nothing to train on from"
            if check_autoep_layout(checkpoint, autoep_size, "resume"):  # its names are AutoEP's, read by DeepSpeed
                return None
            return another_model(checkpoint, shapes, "resume", trusted=cfg.get("trust_checkpoint", False))
        except CheckpointError as error:  # not a Lightning checkpoint at all
            return " ".join(str(error).removeprefix(f"resume: {checkpoint} ").split())

    def newest() -> str:
        if cfg.resume == RESUME_OWN_DIR:  # a requeued job: its own run directory only, never another job's
            found = newest_whole_checkpoint_in(output_dir, passed_over, another_models)
        else:
            # As typed: an override such as `+model.path=${paths.output_dir}/x` resolves to another path in every run.
            overrides = cast(list[str], OmegaConf.to_container(HydraConfig.get().overrides.task, resolve=False))
            found = newest_complete_checkpoint(output_dir.parent, overrides, passed_over, another_models)
        # Whether it ends a finished run is decided here too, by the process that claimed the run directory: resumed
        # into its own directory, the finished run's summary has just been set aside for this attempt (run_dir.py).
        summary = found and as_before_this_attempt(found.parent.parent / SUMMARY_NAME)
        finished = cfg.resume is True and found is not None and finished_run(found, summary) is not None
        return json.dumps({"checkpoint": found and str(found), "finished_summary": str(summary) if finished else None})

    # Global rank 0's choice on every rank of a torchrun job (lifecycle/job_store.py), where each runs this search.
    choice = json.loads(shared_choice(newest, timedelta(seconds=cfg.strategy.get("timeout") or 1800)) or "{}")
    found, finished_summary = choice.get("checkpoint"), choice.get("finished_summary")
    if finished_summary is not None:
        run = Path(found).parent.parent
        raise NothingLeftToTrain(
            f"{said}nothing left to train: the newest whole checkpoint of this command, {found}, is the last save of a"
            f" run that trained to its end ({run / SUMMARY_NAME}); pass ckpt_path={found} with a larger"
            " trainer.max_steps to train on from it, or resume=false to start afresh",
            read_summary(run, Path(finished_summary)))
    if found is None:
        nothing = (f"no complete checkpoint in {output_dir}" if cfg.resume == RESUME_OWN_DIR
                   else "no earlier complete checkpoint of this command")
        log.info(
            said + nothing + (f" (passed over {len(passed)}, named above)" if passed else "") + "; starting afresh"
        )
    elif Path(found).parent.parent != output_dir:
        log.info(f"{said}resuming from {found}: an earlier run's, in {Path(found).parent.parent} ({output_dir} has no"
                 " checkpoint of its own)")
    else:
        log.info(f"{said}resuming from {found}")
    os.environ[RESUME_ENV] = found or ""
    return found


def what_a_stop_keeps(checkpoints: Path) -> str:
    """What a run stopped now leaves to continue from: its newest whole checkpoint in `checkpoints` and its step, or
    that nothing was saved."""
    found = newest_whole_checkpoint_among(checkpoints)
    if found is None:
        return f"nothing was saved before it ({checkpoints} holds no whole checkpoint): resume=true starts afresh"
    step = saved_step(found)
    return f"kept: {found}{'' if step is None else f' at step {step}'} (resume=true continues from it)"
