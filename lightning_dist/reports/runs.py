"""Where `python train.py` puts its runs, and which one is the newest: what a command run right after training
reads when it is not told a directory (the recipes' `show_auto` and `export`)."""

from __future__ import annotations

from pathlib import Path

# conf/train.yaml's hydra.run.dir under the working directory: logs/<task_name>/runs/<start time>.
RUNS = Path("logs") / "train" / "runs"


def newest_run(holding: str, runs: Path = RUNS) -> Path:
    """The newest run directory under `runs` that holds `holding` (a path inside it); run directories are named by
    their start time, so the newest sorts last."""
    found = sorted(run for run in runs.glob("*") if (run / holding).exists())
    if not found:
        raise SystemExit(f"error: no run in {runs} holds {holding}; name the run directory")
    return found[-1]
