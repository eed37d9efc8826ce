"""Find where an interrupted run of the same command got to: its newest checkpoint that is whole."""

from __future__ import annotations

from pathlib import Path

import yaml

from lightning_dist.checkpoints.whole import is_whole

# `resume=run_dir`: only the run directory itself (hydra.run.dir), as a job requeued by its scheduler wants;
# `resume=true` also searches its sibling directories for earlier runs of the same command.
RESUME_OWN_DIR = "run_dir"
# Overrides that do not make a run a different run.
_IGNORED_PREFIXES = ("resume=", "ckpt_path=", "hydra.")


def same_command(overrides: list[str]) -> list[str]:
    return sorted(o for o in overrides if not o.lstrip("+~").startswith(_IGNORED_PREFIXES))


def newest_complete_checkpoint(runs_root: Path, overrides: list[str]) -> Path | None:
    """The newest whole checkpoint among earlier runs under `runs_root` started with the same overrides.

    Runs are Hydra run directories (their `.hydra/overrides.yaml` says how they were started); newer runs are
    searched first, and within a run checkpoints by modification time, skipping any whose save was cut off or that
    changed since (whole.py). The run asking is one of them: a requeued sweep job runs again in its own directory.
    """
    wanted = same_command(overrides)
    runs = [
        run for run in Path(runs_root).glob("*")
        if run.is_dir() and (run / ".hydra" / "overrides.yaml").is_file()
        and same_command(yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text()) or []) == wanted
    ]
    for run in sorted(runs, key=lambda r: r.stat().st_mtime, reverse=True):
        if (found := newest_whole_checkpoint_in(run)) is not None:
            return found
    return None


def newest_whole_checkpoint_in(run: Path) -> Path | None:
    """The newest whole checkpoint in one run directory (`resume=run_dir`: a requeued job's own, whatever its
    overrides), by modification time; a damaged newer one is passed over for an older whole one (whole.py)."""
    # A `.NAME.partial` is a save that has not been swapped in (swap.py); `.NAME.previous`, a complete one that
    # stepped aside for it and is the one to use if the swap was cut off.
    saved = [p for p in (Path(run) / "checkpoints").glob("*") if not p.name.endswith(".partial")]
    for checkpoint in sorted(saved, key=lambda p: p.stat().st_mtime, reverse=True):
        if is_whole(checkpoint):
            return checkpoint
    return None
