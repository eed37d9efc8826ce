"""The last thing a sweep says: where its jobs went, and the command that compares them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class SayWhereTheSweepWent(Callback):
    """Hydra callback (conf/train.yaml, `hydra.callbacks`), on the process that launched the sweep's jobs."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        directory = Path(str(config.hydra.sweep.dir))  # as the user's paths say it: logs/train/multiruns/<date>
        if not any(directory.glob("*/metrics.json")):  # jobs that train nothing (plan=true) leave nothing to compare
            return
        print(f"\nSweep: {directory}\nCompare its jobs: python -m lightning_dist.sweep_report {directory}", flush=True)
