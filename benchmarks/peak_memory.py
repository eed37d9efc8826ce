"""The memory plan's per-device total against the peak a rank really reaches while training.

    python -m benchmarks.peak_memory [--d-model 2048 --n-layer 8] [--strategies ddp fsdp deepspeed_stage_3]

For each strategy, `python train.py` trains the model 3 steps on 2 CPU ranks in fp32 and reports each rank's peak
RSS (benchmarks/step_report.py); the same run with a one-layer 64-wide model is the empty process (imports, the
framework, the data). Growth = peak - empty peak, per rank, against `plan=true`'s per-device total for the model.
The default model has 403.5M parameters.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

from benchmarks.beyond_memory import REPO, run

TOLERANCE = 0.15


def overrides(d_model: int, n_layer: int) -> list[str]:
    return [f"model.d_model={d_model}", f"model.n_layer={n_layer}", f"model.n_head={max(2, d_model // 128)}",
            "model.block_size=64", "data.block_size=64", "data.batch_size=1", "trainer.accelerator=cpu",
            "trainer.devices=2", "test=false", "trainer.limit_val_batches=0", "trainer.num_sanity_val_steps=0",
            "callbacks.model_checkpoint=null", "callbacks.validate_at_max_steps=null"]


def peak_per_rank(strategy: str, model: list[str], out: Path) -> list[int]:
    # This benchmark's earlier result, replaced on purpose: train.py refuses a run directory that holds a run.
    shutil.rmtree(out, ignore_errors=True)
    steps = out / "steps.jsonl"
    run([sys.executable, str(REPO / "train.py"), f"strategy={strategy}", *model, "trainer.max_steps=3",
         "+callbacks.step_report._target_=benchmarks.step_report.StepReport", f"+callbacks.step_report.path={steps}",
         f"hydra.run.dir={out}"])
    return json.loads(steps.read_text().splitlines()[-1])["peak_rss_per_rank"]


def planned_total(strategy: str, model: list[str], out: Path) -> float:
    # This benchmark's earlier result, replaced on purpose: train.py refuses a run directory that holds a run.
    shutil.rmtree(out, ignore_errors=True)
    printed = run([sys.executable, str(REPO / "train.py"), f"strategy={strategy}", *model, "plan=true", f"hydra.run.dir={out}"])
    return float(re.search(r"\| per device \| \*\*total\*\* \| \*\*([0-9.]+)\*\* \|", printed).group(1)) * 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--strategies", nargs="*", default=["ddp", "fsdp", "deepspeed_stage_3"])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "peak_memory")
    args = parser.parse_args()
    model, empty = overrides(args.d_model, args.n_layer), overrides(64, 1)
    print("| strategy | planned per device (GB) | measured growth rank 0 / rank 1 (GB) | measured / planned |")
    print("|---|---:|---:|---:|")
    worst = 0.0
    for strategy in args.strategies:
        out = args.out / strategy
        planned = planned_total(strategy, model, out / "plan")
        baseline = peak_per_rank(strategy, empty, out / "empty")
        growth = [peak - base for peak, base in zip(peak_per_rank(strategy, model, out / "model"), baseline)]
        ratios = [g / planned for g in growth]
        worst = max(worst, *(abs(r - 1) for r in ratios))
        print(f"| {strategy} | {planned / 1e9:.2f} | {' / '.join(f'{g / 1e9:.2f}' for g in growth)} |"
              f" {' / '.join(f'{r:.2f}' for r in ratios)} |", flush=True)
    print(f"\nlargest deviation from the plan: {worst:.0%} (target: within {TOLERANCE:.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
