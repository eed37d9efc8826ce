"""A callback for benchmarks: per optimizer step, each rank's step time and peak RSS, the bytes in an offload
directory, and the loss; rank 0 appends one JSON line per step to `path`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import lightning as L
import torch.distributed as dist


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


class StepReport(L.Callback):
    def __init__(self, path: str, offload_dir: str | None = None) -> None:
        self.path, self.offload_dir = Path(path), offload_dir
        self._started = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        mine = {"seconds": time.perf_counter() - self._started, "peak_rss": _peak_rss_bytes()}
        ranks = [None] * trainer.world_size
        dist.all_gather_object(ranks, mine)
        if trainer.is_global_zero:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            row = {
                "step": trainer.global_step,
                "loss": float(loss),
                "seconds": max(r["seconds"] for r in ranks),
                "peak_rss_per_rank": [r["peak_rss"] for r in ranks],
                "offload_bytes": directory_bytes(self.offload_dir) if self.offload_dir else None,
            }
            with open(self.path, "a") as handle:
                handle.write(json.dumps(row) + "\n")
            print(f"step {row['step']}: loss {row['loss']:.4f}, {row['seconds']:.1f} s, peak RSS per rank "
                  f"{[round(b / 2**30, 2) for b in row['peak_rss_per_rank']]} GiB, offload dir "
                  f"{(row['offload_bytes'] or 0) / 1e9:.1f} GB", flush=True)
