"""Where each rank's time went over the profiled steps, ours against the raw loop: Python, operators, the autograd
engine, and collectives (their waits included), from cProfile files (`+callbacks.p._target_=benchmarks.timing.
StepCProfile`, `raw_loop.py --cprofile`).

    python benchmarks/time_split.py OURS_PREFIX RAW_PREFIX [--ranks 4] [--top 12]

A prefix is the path given to each side (`/tmp/ours.prof` reads `/tmp/ours_rank0.prof`, ...). cProfile's own time
per function (its `tottime`) is put in one bucket each:
- collectives: torch.distributed's C functions (a gloo collective or p2p wait blocks in them: what a rank spends
  waiting for the others, and moving the bytes);
- autograd engine: `run_backward`, the backward's operators run by the C++ engine (its Python hooks are Python);
- operators: every other C function of torch (forward operators, the optimizer's);
- Python: every function written in Python, its own time (cProfile's overhead is charged here too, on both sides).
"""

from __future__ import annotations

import argparse
import pstats
from pathlib import Path

BUCKETS = ("Python", "operators", "autograd engine", "collectives", "other C")


def bucket(key: tuple[str, int, str]) -> str:
    filename, _, name = key
    if filename != "~":
        return "Python"
    if "c10d" in name or "_distributed" in name or "wait" in name:
        return "collectives"
    if "run_backward" in name:
        return "autograd engine"
    if "torch" in name or "TensorBase" in name or "_VariableFunctions" in name:
        return "operators"
    return "other C"


def split(path: Path) -> tuple[dict[str, float], list[tuple[float, str]]]:
    """Seconds by bucket, and the Python functions by their own time."""
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]  # pstats keeps its table there
    seconds = dict.fromkeys(BUCKETS, 0.0)
    python = []
    for key, (_, _, own, _, _) in stats.items():
        kind = bucket(key)
        seconds[kind] += own
        if kind == "Python":
            python.append((own, f"{Path(key[0]).name}:{key[1]}({key[2]})"))
    return seconds, sorted(python, reverse=True)


def own_time_gap(ours: Path, raw: Path, top: int = 8) -> list[tuple[float, str]]:
    """The functions whose own time ours exceeds raw's by the most (seconds, name), Python and C alike: where
    ours' extra time goes, function by function."""
    def own(path: Path) -> dict[str, float]:
        stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
        return {f"{Path(key[0]).name}:{key[1]}({key[2]})" if key[0] != "~" else key[2]: row[2]
                for key, row in stats.items()}

    ours_own, raw_own = own(ours), own(raw)
    gaps = [(seconds - raw_own.get(name, 0.0), name) for name, seconds in ours_own.items()]
    return sorted(gaps, reverse=True)[:top]


def rank_file(prefix: Path, rank: int) -> Path:
    return prefix.with_name(f"{prefix.stem}_rank{rank}.prof")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ours", type=Path)
    parser.add_argument("raw", type=Path)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--top", type=int, default=12, help="Python functions listed per side, by own time (rank 0)")
    args = parser.parse_args()
    print("| rank | side | total (s) | " + " | ".join(f"{name} (s)" for name in BUCKETS) + " |")
    print("|---|---|---:|" + "---:|" * len(BUCKETS))
    for rank in range(args.ranks):
        for side, prefix in (("ours", args.ours), ("raw", args.raw)):
            seconds, _ = split(rank_file(prefix, rank))
            cells = " | ".join(f"{seconds[name]:.2f}" for name in BUCKETS)
            print(f"| {rank} | {side} | {sum(seconds.values()):.2f} | {cells} |")
    for side, prefix in (("ours", args.ours), ("raw", args.raw)):
        _, python = split(rank_file(prefix, 0))
        print(f"\nRank 0, {side}: Python functions by own time")
        for own, name in python[:args.top]:
            print(f"  {own:7.3f} s  {name}")
    print("\nRank 0: own time ours spent beyond raw's, by function")
    for gap, name in own_time_gap(rank_file(args.ours, 0), rank_file(args.raw, 0), args.top):
        print(f"  {gap:+7.3f} s  {name}")


if __name__ == "__main__":
    main()
