"""Run one configuration under several strategies and compare the per-step training losses.

DDP, FSDP and ZeRO are the same mathematics distributed differently: in float32 with the same seed, data order
and global batch, their loss curves must agree to rounding. This runs the training entry point (`python -m
lightning_dist.run.cli`, what `train.py` calls) once per strategy and reports how far each curve is from the
reference one, step by step.

    python -m lightning_dist.reports.equivalence --strategies ddp,fsdp,deepspeed_stage_3 -- trainer.max_steps=30
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from lightning_dist.reports.summary_file import curve, read_summary

# The entry point `lightning-dist-train` and `python train.py` run, as a module: found wherever the package is
# installed.
TRAIN_COMMAND = ("-m", "lightning_dist.run.cli")
# Per-step losses, and nothing that does not change the training trajectory.
COMPARISON_OVERRIDES = ("trainer.log_every_n_steps=1", "test=false")


@dataclass
class StrategyCurve:
    strategy: str
    losses: dict[int, float]
    returncode: int
    run_dir: Path
    output: str = ""  # what the run printed (stdout, then stderr)

    def max_relative_difference(self, reference: StrategyCurve) -> float:
        steps = reference.losses.keys() & self.losses.keys()
        if not steps or steps != reference.losses.keys():
            return float("inf")  # a curve that stopped early does not match
        return max(abs(self.losses[s] - reference.losses[s]) / abs(reference.losses[s]) for s in steps)


def read_train_losses(run_dir: Path) -> dict[int, float]:
    """{step: train_loss} from the run's summary (`metrics.json`), whichever loggers it had."""
    return curve(read_summary(run_dir), "train_loss")


def run_strategy(strategy: str, overrides: list[str], run_dir: Path) -> StrategyCurve:
    command = [sys.executable, *TRAIN_COMMAND, f"strategy={strategy}", f"hydra.run.dir={run_dir}",
               *COMPARISON_OVERRIDES, *overrides]
    process = subprocess.run(command, capture_output=True, text=True)
    if process.returncode:
        sys.stderr.write(process.stderr[-3000:])
    return StrategyCurve(strategy, read_train_losses(run_dir), process.returncode, Path(run_dir),
                         process.stdout + process.stderr)


def compare_strategies(
    strategies: list[str], overrides: list[str], workdir: Path, reference: str = "ddp"
) -> dict[str, StrategyCurve]:
    """Run `reference` and every strategy in `strategies` with the same overrides; curves keyed by strategy."""
    names = [reference, *(s for s in strategies if s != reference)]
    return {name: run_strategy(name, overrides, Path(workdir) / name) for name in names}


def format_report(curves: dict[str, StrategyCurve], reference: str = "ddp") -> str:
    base = curves[reference]
    lines = ["| strategy | steps | final loss | max relative difference vs " + reference + " |", "|---|---|---|---|"]
    for name, losses in curves.items():
        final = losses.losses[max(losses.losses)] if losses.losses else float("nan")
        lines.append(f"| {name} | {len(losses.losses)} | {final:.6f} | {losses.max_relative_difference(base):.2e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", required=True, help="comma-separated strategy options, e.g. ddp,fsdp")
    parser.add_argument("--reference", default="ddp")
    parser.add_argument("--workdir", type=Path, default=Path("logs/equivalence"))
    parser.add_argument("overrides", nargs="*", help="Hydra overrides shared by every run")
    args = parser.parse_args(argv)
    curves = compare_strategies(args.strategies.split(","), args.overrides, args.workdir, args.reference)
    print(format_report(curves, args.reference))
    return max(curve.returncode for curve in curves.values())


if __name__ == "__main__":
    sys.exit(main())
