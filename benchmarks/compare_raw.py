"""Ours against the same engine driven by hand: median iteration time, throughput and peak memory per rank.

    python benchmarks/compare_raw.py                      # ddp, fsdp, deepspeed_stage_2, deepspeed_stage_3
    python benchmarks/compare_raw.py --steps 60 --repeats 3 ddp

Runs alternate (ours, raw, raw, ours, ...), so a machine that slows down over time does not favour either side.
Both sides train the default model (tiny GPT, 2 CPU ranks, batch 16 x 128 per rank) on the same data with the same
AdamW; DeepSpeed's raw loop uses the very config our strategy resolved. Our side is `train.py` as users run it:
progress bar, CSV logging and the training monitor (with its per-step NaN check) all on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WARMUP = 3  # iterations left out of the median: allocation, JIT, first collectives
ENGINE = {"ddp": "ddp", "fsdp": "fsdp", "deepspeed_stage_2": "deepspeed", "deepspeed_stage_3": "deepspeed"}


def run_ours(strategy: str, steps: int, out: Path) -> dict:
    run_dir = out / f"ours_{strategy}"
    command = [
        sys.executable, str(REPO / "train.py"), f"strategy={strategy}", f"trainer.max_steps={steps}", "test=false",
        "trainer.limit_val_batches=0", "trainer.num_sanity_val_steps=0", f"hydra.run.dir={run_dir}",
        "+callbacks.iteration_timer._target_=benchmarks.timing.IterationTimer",
        f"+callbacks.iteration_timer.path={run_dir}/iterations.json",
    ]
    _run(command)
    iterations = [json.loads((run_dir / f"iterations_rank{r}.json").read_text()) for r in (0, 1)]
    peaks = [rank["bytes"] for rank in json.loads((run_dir / "metrics.json").read_text())["peak_memory_per_rank"]]
    return {"iterations": iterations, "peaks": peaks}


def run_raw(strategy: str, steps: int, out: Path) -> dict:
    result = out / f"raw_{strategy}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(REPO / "benchmarks" / "raw_loop.py"), "--strategy", ENGINE[strategy], "--steps", str(steps), "--out", str(result)]
    if ENGINE[strategy] == "deepspeed":
        command += ["--deepspeed-config", str(out / f"ours_{strategy}" / "deepspeed_config.effective.json")]
    _run(command)
    ranks = json.loads(result.read_text())
    return {"iterations": [rank["iteration_s"] for rank in ranks], "peaks": [rank["peak_rss"] for rank in ranks]}


def _run(command: list[str]) -> None:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    process = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if process.returncode:
        raise SystemExit(f"failed ({process.returncode}): {' '.join(command)}\n{process.stderr[-3000:]}")


def median_iteration(runs: list[dict]) -> float:
    # The slower rank sets the pace of a synchronous step: per iteration, the max over ranks.
    per_run = [[max(times) for times in zip(*run["iterations"])][WARMUP:] for run in runs]
    return statistics.median(t for times in per_run for t in times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("strategies", nargs="*", default=list(ENGINE))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    results = {name: {"ours": [], "raw": []} for name in args.strategies}
    for repeat in range(args.repeats):
        for name in args.strategies:
            # Ours first on even repeats (its DeepSpeed config feeds the raw loop), raw first on odd ones.
            for side in ("ours", "raw") if repeat % 2 == 0 else ("raw", "ours"):
                runner = run_ours if side == "ours" else run_raw
                results[name][side].append(runner(name, args.steps, args.out))
                print(f"repeat {repeat + 1}/{args.repeats}: {name} {side} done", flush=True)

    samples = 2 * 16  # per iteration, over both ranks
    print("\n| strategy | ours median iteration (ms) | raw (ms) | ours/raw | ours samples/s | raw samples/s | "
          "ours peak RSS per rank (MB) | raw (MB) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    summary = {}
    for name, sides in results.items():
        ours, raw = median_iteration(sides["ours"]), median_iteration(sides["raw"])
        peak = {side: max(max(run["peaks"]) for run in sides[side]) / 1e6 for side in sides}
        summary[name] = {"ours_s": ours, "raw_s": raw, "ratio": ours / raw, "peak_mb": peak}
        print(f"| {name} | {ours * 1e3:.1f} | {raw * 1e3:.1f} | {ours / raw:.3f} | {samples / ours:.1f} | "
              f"{samples / raw:.1f} | {peak['ours']:.0f} | {peak['raw']:.0f} |")
    (args.out / "compare_raw.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
