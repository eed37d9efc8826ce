"""Reading a run's `metrics.json` (written by `callbacks.RunSummary`): what the sweep report and the equivalence
check compare, the same whichever loggers the run had."""

from __future__ import annotations

import json
from pathlib import Path

SUMMARY_NAME = "metrics.json"


def read_summary(run_dir: Path, path: Path | None = None) -> dict:
    """The run's summary; {} for a run that did not finish (it is written at the end of training and of testing).
    `path`: where it is when not in `run_dir` (set aside while the run is continued: `metrics.1.json`)."""
    path = Path(path or Path(run_dir) / SUMMARY_NAME)
    return json.loads(path.read_text()) if path.exists() else {}


def curve(summary: dict, name: str) -> dict[int, float]:
    """{step: value} of a curve the summary recorded (`train_loss`, `val_loss`)."""
    return {int(step): value for step, value in (summary.get("curves") or {}).get(name, {}).items()}
