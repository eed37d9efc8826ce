"""A NaN stop, again and again, under a background CPU load: every run must exit 1 (a rank Lightning started used
to exit first with 1, and Lightning's observer then killed rank 0: exit 137, about 1 run in 10 under load).

    python -m scripts.nan_stop_loop --runs 20 --workdir /tmp/nan_loop

The test suite forces the race once instead (tests/callbacks/test_training_monitor.py: rank 0 made to leave last).
"""

from __future__ import annotations

import argparse
import multiprocessing
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OVERRIDES = (
    "strategy=ddp", "trainer.devices=2", "trainer.max_steps=10", "test=false", "trainer.log_every_n_steps=1",
    "+callbacks.nan._target_=tests.probes.InjectNaN", "+callbacks.nan.module=model.blocks.1.mlp",
    "+callbacks.nan.global_step=6", "+callbacks.nan.rank=1",
)


def spin(stop_at: float) -> None:
    while time.monotonic() < stop_at:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--load", type=int, default=2, help="busy processes beside the runs")
    parser.add_argument("--workdir", type=Path, default=Path("nan_loop"))
    args = parser.parse_args()
    hogs = [multiprocessing.Process(target=spin, args=(time.monotonic() + 24 * 3600,), daemon=True)
            for _ in range(args.load)]
    for hog in hogs:
        hog.start()
    codes: Counter[int] = Counter()
    try:
        for index in range(args.runs):
            run_dir = args.workdir / f"run{index}"
            process = subprocess.run([sys.executable, str(REPO / "train.py"), f"hydra.run.dir={run_dir}", *OVERRIDES],
                                     cwd=REPO, capture_output=True, text=True, timeout=600)
            codes[process.returncode] += 1
            print(f"run {index:3d}: exit {process.returncode}", flush=True)
    finally:
        for hog in hogs:
            hog.terminate()
    print("\nexit code | runs")
    for code, count in sorted(codes.items()):
        print(f"{code:9d} | {count}")
    return 0 if set(codes) == {1} else 1


if __name__ == "__main__":
    sys.exit(main())
