"""Every preset resumes from every other preset's checkpoint: the whole matrix, as a table.

    python -m scripts.resume_matrix [--workdir logs/resume_matrix] [--presets ddp,fsdp,...]

Each source preset trains 17 steps with a checkpoint at step 15; each target preset resumes from it for two
steps. A cell shows the largest relative difference of those two losses from the source's (float32: ~1e-7 when
the weights, Adam's state and the data position all arrived), or the exit code of a run that failed. The test
suite runs one row per target (tests/checkpoints/test_cross_strategy_resume.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lightning_dist.reports.equivalence import run_strategy
from tests.conftest import STRATEGY_NAMES

MODEL = ("model._target_=tests.models.checkpoint_probe.CheckpointProbeGPT", "+model.gathered_path=${paths.output_dir}/gathered_state.pt")
QUIET = ("callbacks.validate_at_max_steps=null", "trainer.num_sanity_val_steps=0")
SOURCE = (*MODEL, *QUIET, "trainer.max_steps=17", "callbacks.model_checkpoint.every_n_train_steps=15",
          "callbacks.model_checkpoint.monitor=null")
TARGET = (*MODEL, *QUIET, "trainer.max_steps=17", "callbacks.model_checkpoint=null")


def cell(source, resumed) -> str:
    if resumed.returncode:
        return f"exit {resumed.returncode}"
    if sorted(resumed.losses) != [15, 16]:
        return f"steps {sorted(resumed.losses)}"
    return f"{max(abs(resumed.losses[s] - source.losses[s]) / abs(source.losses[s]) for s in (15, 16)):.1e}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("logs/resume_matrix"))
    parser.add_argument("--presets", default=",".join(STRATEGY_NAMES))
    args = parser.parse_args(argv)
    presets = args.presets.split(",")
    sources = {name: run_strategy(name, list(SOURCE), args.workdir / "source" / name) for name in presets}
    print("| from \\ to | " + " | ".join(presets) + " |")
    print("|---" * (len(presets) + 1) + "|")
    for name, source in sources.items():
        checkpoint = source.run_dir / "checkpoints" / "step000015.ckpt"
        cells = [
            "-" if target == name else
            cell(source, run_strategy(target, [*TARGET, f"ckpt_path={checkpoint}"], args.workdir / name / target))
            for target in presets
        ]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
