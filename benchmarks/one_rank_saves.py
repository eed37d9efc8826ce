"""A 1-rank CPU run's step time before and after its first sharded save, and after a resume from it.

    python benchmarks/one_rank_saves.py            # fsdp, 1 CPU rank, gpt_tiny and a 24-block GPT (about 5 min)

torch.distributed.checkpoint exchanges each rank's plan over gloo, even at world size 1. Once a plan outgrows ATen's
grain size, gloo's worker thread copies it in parallel and starts an OpenMP team of its own; libgomp, with more
threads than cores, then throttles its spin-wait and every later parallel op of the training waits on a sleeping
worker. lightning-dist saves and loads as one process at world size 1 (`no_dist`); `torch_default` runs the same
command with torch's default put back (a callback of this file), for the comparison. `train.py` as users run it,
`trainer.devices=1`, a save of `last` at step 50 (the default cadence), each mode twice, alternating.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L

REPO = Path(__file__).resolve().parents[1]
SAVED_AT, STEPS = 50, 100
# The default GPT, and one whose step is mostly the host's (24 blocks, as gpt_medium has, of width 32; a 32-token batch)
MODELS = {"gpt_tiny": (), "24 blocks x 32": ("model.n_layer=24", "model.d_model=32", "model.n_head=2",
                                             "data.batch_size=1", "data.block_size=32")}


class TorchDefaultPlans(L.Callback):
    """Puts torch.distributed.checkpoint's default back: plans exchanged over the process group at any world size."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        import torch.distributed.checkpoint as dcp

        for name in ("save", "load"):
            original = getattr(dcp, name)

            def exchanged(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                return _original(*args, **{**kwargs, "no_dist": False})

            setattr(dcp, name, exchanged)


def step_times(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "csv" / "metrics.csv") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("monitor/step_time_s")]
    return {int(row["step"]) + 1: float(row["monitor/step_time_s"]) * 1e3 for row in rows}  # by global step


def train(run_dir: Path, model: tuple[str, ...], mode: str, *extra: str) -> dict[int, float]:
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, str(REPO / "train.py"), "strategy=fsdp", "trainer.devices=1", *model,
               f"trainer.max_steps={STEPS}", "trainer.val_check_interval=1000", "trainer.num_sanity_val_steps=0",
               "callbacks.validate_at_max_steps=null", "trainer.log_every_n_steps=1", "test=false",
               # every save kept: step 50's to resume from (and `last`, on its own cadence, at step 50 too)
               f"callbacks.model_checkpoint.every_n_train_steps={SAVED_AT}", "callbacks.model_checkpoint.monitor=null",
               "callbacks.model_checkpoint.save_top_k=-1", f"hydra.run.dir={run_dir}", *extra]
    if mode == "torch_default":
        command.append("+callbacks.torch_default._target_=benchmarks.one_rank_saves.TorchDefaultPlans")
    process = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1200, env=os.environ)
    if process.returncode:
        raise SystemExit(f"failed: {' '.join(command)}\n{process.stderr[-3000:]}")
    return step_times(run_dir)


def median(times: dict[int, float], first: int, last: int) -> float:
    return statistics.median(t for step, t in times.items() if first <= step <= last)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "one_rank_saves")
    args = parser.parse_args()
    rows = []
    for model_name, model in MODELS.items():
        results: dict[str, list[tuple[float, float, float]]] = {"lightning_dist": [], "torch_default": []}
        for order in (("torch_default", "lightning_dist"), ("lightning_dist", "torch_default")):
            for mode in order:
                fresh = train(args.out / "fresh", model, mode)
                step50 = args.out / "fresh" / "checkpoints" / f"step{SAVED_AT:06d}.ckpt"
                resumed = train(args.out / "resumed", model, mode, f"ckpt_path={step50}")
                results[mode].append((median(fresh, 6, SAVED_AT), median(fresh, SAVED_AT + 3, STEPS),
                                      median(resumed, SAVED_AT + 3, STEPS)))
                print(f"{model_name}, {mode}: done", flush=True)
        for mode, measured in results.items():
            before, after, resumed_ = (statistics.median(column) for column in zip(*measured))
            rows.append(f"| {model_name} | {mode} | {before:.1f} | {after:.1f} | {after / before:.2f} |"
                        f" {resumed_:.1f} | {resumed_ / before:.2f} |")
    print(f"\nfsdp, 1 CPU rank ({os.cpu_count()} cores), `last` saved at step {SAVED_AT}; medians of 2 runs each:\n")
    print("| model | checkpoint plans | steps 6-50 (ms) | steps 53-100 after the save (ms) | after / before |"
          " resumed from step 50: steps 53-100 (ms) | resumed / before |")
    print("|---|---|---:|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
