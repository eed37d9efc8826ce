"""Time to first step: `python train.py` from process start to its first optimizer step, and to exit.

    python benchmarks/first_step.py                  # the README's main command, 3 times (about 3 min)
    python benchmarks/first_step.py --runs 5 strategy=deepspeed_stage_3

Cold Python each run (a new interpreter, imports included); DeepSpeed's native ops are expected to be built
already (`~/.cache/torch_extensions`), as they are after a first run. Prints each run and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_FIRST_STEP_S, TARGET_EXIT_S = 20.0, 120.0


def one_run(overrides: list[str], work: Path) -> dict[str, float]:
    milestones = work / "milestones.json"
    command = [sys.executable, str(REPO / "train.py"), *overrides, f"hydra.run.dir={work}",
               "+callbacks.milestones._target_=benchmarks.timing.Milestones", f"+callbacks.milestones.path={milestones}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    started = time.time()
    process = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    ended = time.time()
    if process.returncode:
        raise SystemExit(f"failed ({process.returncode}): {' '.join(command)}\n{process.stderr[-3000:]}")
    times = json.loads(milestones.read_text())
    return {"setup_done": times["setup_done"] - started, "first_step": times["first_step"] - started, "exit": ended - started}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="train.py overrides (none: the README's main command)")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    runs = []
    print("| run | setup done (s) | first optimizer step (s) | exit (s) |\n|---:|---:|---:|---:|")
    for index in range(args.runs):
        with tempfile.TemporaryDirectory() as work:
            runs.append(one_run(args.overrides, Path(work)))
        print(f"| {index + 1} | {runs[-1]['setup_done']:.1f} | {runs[-1]['first_step']:.1f} | {runs[-1]['exit']:.1f} |", flush=True)
    median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    print(f"| median | {median['setup_done']:.1f} | {median['first_step']:.1f} | {median['exit']:.1f} |")
    print(f"\nfirst step: median {median['first_step']:.1f} s (target < {TARGET_FIRST_STEP_S:.0f} s); "
          f"end to end: median {median['exit']:.1f} s (target < {TARGET_EXIT_S:.0f} s)")
    return 0 if median["first_step"] < TARGET_FIRST_STEP_S and median["exit"] < TARGET_EXIT_S else 1


if __name__ == "__main__":
    sys.exit(main())
