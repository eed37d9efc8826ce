"""Activation checkpointing's forms on one model: none, every block, op-level, every k-th block. Per form: the
median iteration, each rank's peak RSS, and the activations the memory plan expects.

    python benchmarks/selective_checkpointing.py                       # fsdp, gpt_medium, 10 steps (about 15 min)
    python benchmarks/selective_checkpointing.py --strategy ddp --forms false ops

Runs `train.py` as users do (`strategy.activation_checkpointing=<form>`), 2 CPU ranks, in the order given, twice,
alternating (forward then backward), so a machine that slows down favours no form.
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
FORMS = ("false", "true", "ops", "2")
WARMUP = 3
MODEL = ("model=gpt_medium", "data.batch_size=8")  # activations a third of a rank's peak, not a tenth
# Every allocation of 1 MiB or more mapped on its own, so that peak RSS follows the live tensors (glibc's default
# keeps freed heap at will: about 100 MB of noise, the size of the differences measured here).
EXACT_RSS = {"MALLOC_MMAP_THRESHOLD_": "1048576", "MALLOC_TRIM_THRESHOLD_": "1048576"}


def run(strategy: str, form: str, out: Path, steps: int) -> dict:
    run_dir = out / f"{strategy}_{form}"
    shutil.rmtree(run_dir, ignore_errors=True)  # this benchmark's earlier result: train.py refuses a used directory
    command = [sys.executable, str(REPO / "train.py"), f"strategy={strategy}", f"strategy.activation_checkpointing={form}",
               *MODEL, f"trainer.max_steps={steps}", "test=false", "trainer.limit_val_batches=0",
               "trainer.num_sanity_val_steps=0", f"hydra.run.dir={run_dir}",
               "+callbacks.iteration_timer._target_=benchmarks.timing.IterationTimer",
               f"+callbacks.iteration_timer.path={run_dir}/iterations.json"]
    process = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1800, env={**os.environ, **EXACT_RSS})
    if process.returncode:
        raise SystemExit(f"failed: {' '.join(command)}\n{process.stderr[-3000:]}")
    iterations = [json.loads((run_dir / f"iterations_rank{r}.json").read_text()) for r in range(2)]
    summary = json.loads((run_dir / "metrics.json").read_text())
    return {"iterations": [max(pair) for pair in zip(*iterations)][WARMUP:],
            "peak": max(rank["bytes"] for rank in summary["peak_memory_per_rank"])}


def planned_activations(strategy: str, form: str) -> float:
    """The plan's activations per device (`plan=true`'s table), in MB."""
    process = subprocess.run([sys.executable, str(REPO / "train.py"), f"strategy={strategy}",
                              f"strategy.activation_checkpointing={form}", *MODEL, "plan=true"],
                             cwd=REPO, capture_output=True, text=True, timeout=600)
    row = next(line for line in process.stdout.splitlines() if line.startswith("| per device | activations |"))
    return float(row.split("|")[3]) * 1000  # GB -> MB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--forms", nargs="*", default=list(FORMS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "selective_checkpointing")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {form: [] for form in args.forms}
    for repeat in range(2):
        for form in args.forms if repeat == 0 else reversed(args.forms):
            results[form].append(run(args.strategy, form, args.out, args.steps))
            print(f"repeat {repeat + 1}/2: {form} done", flush=True)
    print(f"\n{args.strategy}, gpt_medium, batch 8 x 128 per rank, 2 CPU ranks:\n")
    print("| activation_checkpointing | median iteration (ms) | peak RSS per rank (MB) | planned activations (MB) |")
    print("|---|---:|---:|---:|")
    for form, runs in results.items():
        median = statistics.median(t for one in runs for t in one["iterations"])
        peak = max(one["peak"] for one in runs) / 1e6
        print(f"| {form} | {median * 1e3:.0f} | {peak:.0f} | {planned_activations(args.strategy, form):.0f} |")


if __name__ == "__main__":
    main()
