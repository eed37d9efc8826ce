"""The Lightning side's clock: the start of one training batch to the start of the next, as `raw_loop.py` times
(data loading, every hook and callback included; what follows the last batch, validation and saving, is not)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import lightning as L


class IterationTimer(L.Callback):
    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module) -> None:
        iterations = [b - a for a, b in zip(self.starts, self.starts[1:])]
        self.path.with_name(f"{self.path.stem}_rank{trainer.global_rank}.json").write_text(json.dumps(iterations))
