"""Find where an interrupted run of the same command got to: its newest checkpoint that is whole, naming each
newer one passed over and why."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import yaml

from lightning_dist.checkpoints.formats import cannot_read, is_complete, unreadable
from lightning_dist.checkpoints.whole import first_problem
from lightning_dist.reports.summary_file import read_summary

# `resume=run_dir`: only the run directory itself (hydra.run.dir), as a job requeued by its scheduler wants;
# `resume=true` also searches its sibling directories for earlier runs of the same command.
RESUME_OWN_DIR = "run_dir"
# Overrides that do not make a run a different run.
_IGNORED_PREFIXES = ("resume=", "ckpt_path=", "hydra.")

PassedOver = Callable[[Path, str], None]  # told each checkpoint the search passes over, and why
Vet = Callable[[Path], "str | None"]  # why a whole checkpoint cannot serve this run (another model's), or None


def same_command(overrides: list[str]) -> list[str]:
    return sorted(o for o in overrides if not o.lstrip("+~").startswith(_IGNORED_PREFIXES))


def newest_complete_checkpoint(runs_root: Path, overrides: list[str], passed_over: PassedOver = lambda path, why: None,
                               vet: Vet = lambda path: None) -> Path | None:
    """The newest whole checkpoint among earlier runs under `runs_root` started with the same overrides.

    Runs are Hydra run directories (their `.hydra/overrides.yaml` says how they were started); newer runs are
    searched first, and within a run checkpoints by modification time, skipping any whose save was cut off or that
    changed since (whole.py). The run asking is one of them: a requeued sweep job runs again in its own directory.
    """
    wanted = same_command(overrides)
    runs = [run for run in Path(runs_root).glob("*") if _started_with(run) == wanted]
    for run in sorted(runs, key=_modified, reverse=True):
        if (found := newest_whole_checkpoint_in(run, passed_over, vet)) is not None:
            return found
    return None


def newest_whole_checkpoint_in(run: Path, passed_over: PassedOver = lambda path, why: None,
                                vet: Vet = lambda path: None) -> Path | None:
    """The newest whole checkpoint in one run directory (`resume=run_dir`: a requeued job's own, whatever its
    overrides), by modification time; a damaged newer one, or one `vet` refuses, is passed over for an older whole
    one (whole.py)."""
    return newest_whole_checkpoint_among(Path(run) / "checkpoints", passed_over, vet)


def newest_whole_checkpoint_among(directory: Path, passed_over: PassedOver = lambda path, why: None,
                                  vet: Vet = lambda path: None) -> Path | None:
    """The newest whole checkpoint in a directory of checkpoints (`newest_whole_checkpoint_in`)."""
    # A `.NAME.partial` is a save that has not been swapped in (swap.py); `.NAME.previous`, a complete one that
    # stepped aside for it and is the one to use if the swap was cut off.
    saved = [p for p in Path(directory).glob("*") if not p.name.endswith(".partial")]
    for checkpoint in sorted(saved, key=_modified, reverse=True):
        try:
            problem = unusable(checkpoint) or vet(checkpoint)
        except OSError as error:  # a file that vanished, or could not be read, while it was being looked at
            problem = cannot_read(error)
        if problem is None:
            return checkpoint
        passed_over(checkpoint, problem)
    return None


def unusable(checkpoint: Path) -> str | None:
    """Why `checkpoint` cannot be resumed from (a link to nothing, a file that cannot be read, a save cut off, a
    file changed since), or None."""
    if checkpoint.is_symlink() and not checkpoint.exists():
        return f"a link to {checkpoint.readlink()}, which does not exist"
    if problem := unreadable(checkpoint):
        return problem
    if not is_complete(checkpoint):
        return "its save did not finish"
    return first_problem(checkpoint)


def finished_run(checkpoint: Path, summary_at: Path | None = None) -> Path | None:
    """The run directory `checkpoint` was saved in, if that run trained to its end and `checkpoint` is its last
    save (its summary says both): resuming from it would train nothing. `summary_at`: where that run's summary is
    when not in its directory (set aside by the attempt that continues it)."""
    run = checkpoint.parent.parent
    summary = read_summary(run, summary_at)
    finished = "global_step" in summary and "stopped_by" not in summary
    last = summary.get("last_checkpoint")
    return run if finished and last and Path(last).resolve() == checkpoint.resolve() else None


def _started_with(run: Path) -> list[str] | None:
    """The overrides a run directory's run was started with, as `same_command` compares them; None for what is no
    run directory, or one whose record cannot be read."""
    try:
        return same_command(yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text()) or [])
    except (OSError, yaml.YAMLError):
        return None


def _modified(path: Path) -> float:
    # A link to nothing has no target to ask; its own time places it. One removed meanwhile goes last.
    try:
        return path.stat().st_mtime if path.exists() else path.lstat().st_mtime
    except OSError:
        return 0.0
