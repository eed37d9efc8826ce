"""Find where an interrupted run of the same command got to: its newest checkpoint that is whole."""

from __future__ import annotations

from pathlib import Path

import yaml

from lightning_dist.checkpoints.whole import is_whole

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
        # A `.NAME.partial` is a save that has not been swapped in (swap.py); `.NAME.previous`, a complete one that
        # stepped aside for it and is the one to use if the swap was cut off.
        saved = [p for p in (run / "checkpoints").glob("*") if not p.name.endswith(".partial")]
        checkpoints = sorted(saved, key=lambda p: p.stat().st_mtime, reverse=True)
        for checkpoint in checkpoints:
            if is_whole(checkpoint):  # a damaged newer one is passed over for an older whole one
                return checkpoint
    return None
