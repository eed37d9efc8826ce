"""How long the command line takes to answer when it trains nothing: `--help`, `--cfg job`, and a refused override.

    python benchmarks/cli_startup.py            # each 3 times; prints a table, the medians and the 3 s target

A new interpreter each time, from a temporary working directory. The command line imports only Hydra
(`lightning_dist/run/cli.py`); torch, Lightning and DeepSpeed load when a job runs.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_S = 3.0
COMMANDS = {
    "--help": ["--help"],
    "--cfg job": ["--cfg", "job"],
    "refused override": ["strategy=fsdp_zero9"],
}


def seconds(arguments: list[str], cwd: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, str(REPO / "train.py"), *arguments], cwd=cwd, capture_output=True, check=False)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print(f"| command | {' | '.join(f'run {i + 1} (s)' for i in range(args.runs))} | median (s) | median / target |")
    print("|---|" + "---:|" * (args.runs + 2))
    medians = {}
    with tempfile.TemporaryDirectory() as cwd:
        for name, arguments in COMMANDS.items():
            times = [seconds(arguments, cwd) for _ in range(args.runs)]
            medians[name] = statistics.median(times)
            print(f"| `python train.py {' '.join(arguments)}` | {' | '.join(f'{t:.2f}' for t in times)} | "
                  f"{medians[name]:.2f} | {medians[name] / TARGET_S:.2f} |", flush=True)
    print(f"\ntarget: under {TARGET_S:.0f} s each (median of {args.runs})")
    return 0 if all(median < TARGET_S for median in medians.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
