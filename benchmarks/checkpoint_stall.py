"""How long training stops at a checkpoint, written synchronously and in the background (`checkpoint.async=true`).

    python benchmarks/checkpoint_stall.py                      # fsdp, gpt_medium (57M), 2 CPU ranks (about 6 min)
    python benchmarks/checkpoint_stall.py --strategy ddp

Runs `train.py` as users do (batch 2 x 128 per rank, as compare_raw.py), saving every 4 steps (the step's checkpoint
and `last`, as the default callbacks do), each mode twice, alternating. An iteration is one batch start to the next
(benchmarks/timing.py), so the iteration that ends in a save holds the step's stall: that iteration against the
median of the others. The iteration after a save is reported too: on 2 cores the background write competes with
training for the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EVERY = 4
STEPS = 26
WARMUP = 3


def run(strategy: str, asynchronous: bool, out: Path) -> dict[str, list[float]]:
    run_dir = out / f"{strategy}_{'async' if asynchronous else 'sync'}"
    shutil.rmtree(run_dir, ignore_errors=True)  # this benchmark's earlier result: train.py refuses a used directory
    command = [sys.executable, str(REPO / "train.py"), f"strategy={strategy}", "model=gpt_medium",
               "data.batch_size=2", f"checkpoint.async={str(asynchronous).lower()}", f"trainer.max_steps={STEPS}",
               "test=false",
               "trainer.limit_val_batches=0", "trainer.num_sanity_val_steps=0", "callbacks.validate_at_max_steps=null",
               f"callbacks.model_checkpoint.every_n_train_steps={EVERY}", "callbacks.model_checkpoint.monitor=null",
               f"hydra.run.dir={run_dir}", "+callbacks.iteration_timer._target_=benchmarks.timing.IterationTimer",
               f"+callbacks.iteration_timer.path={run_dir}/iterations.json"]
    process = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1800, env=os.environ)
    if process.returncode:
        raise SystemExit(f"failed: {' '.join(command)}\n{process.stderr[-3000:]}")
    ranks = [json.loads((run_dir / f"iterations_rank{r}.json").read_text()) for r in range(2)]
    iterations = [max(pair) for pair in zip(*ranks)]  # iteration i: batch i+1's start to batch i+2's
    saving = {step - 1 for step in range(EVERY, STEPS, EVERY)}  # ends with the save after optimizer step `step`
    kinds: dict[str, list[float]] = {"saving": [], "after": [], "other": []}
    for index, seconds in enumerate(iterations):
        if index < WARMUP:
            continue
        kind = "saving" if index in saving else "after" if index - 1 in saving else "other"
        kinds[kind].append(seconds)
    return kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "checkpoint_stall")
    args = parser.parse_args()
    results: dict[bool, dict[str, list[float]]] = {False: {}, True: {}}
    for repeat, order in enumerate(((False, True), (True, False))):
        for asynchronous in order:
            for kind, seconds in run(args.strategy, asynchronous, args.out).items():
                results[asynchronous].setdefault(kind, []).extend(seconds)
            print(f"repeat {repeat + 1}/2: {'async' if asynchronous else 'sync'} done", flush=True)
    stall = {mode: statistics.median(r["saving"]) - statistics.median(r["other"]) for mode, r in results.items()}
    print(f"\n{args.strategy}, gpt_medium, batch 2 x 128 per rank, a save every {EVERY} steps (the step's checkpoint"
          " and last), 2 CPU ranks:\n")
    print("| checkpoint.async | iteration without a save (ms) | iteration ending in a save (ms) | stall (ms) |"
          " stall / synchronous | iteration after a save (ms) |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode, r in results.items():
        other, saving, after = (statistics.median(r[kind]) * 1e3 for kind in ("other", "saving", "after"))
        print(f"| {str(mode).lower()} | {other:.0f} | {saving:.0f} | {stall[mode] * 1e3:.0f}"
              f" | {stall[mode] / stall[False]:.2f} | {after:.0f} |")


if __name__ == "__main__":
    main()
