"""Host reads per training step, for every preset: the reads in steps that neither log, refresh the bar, validate nor
save (on a GPU, each a wait for the device), by the code that asked for them.

    python benchmarks/host_syncs.py                  # every preset on 2 CPU ranks (hsdp_tp on 4), 20 steps (4 min)
    python benchmarks/host_syncs.py ddp deepspeed_stage_3 --steps 40
    python benchmarks/host_syncs.py fsdp_pp "fsdp cp 2"  # pipeline stages; context parallelism (2 ranks a sequence)

Each run is `train.py strategy=<preset> trainer.devices=2 'callbacks=[default,host_syncs]'` with the default
`log_every_n_steps=5`; lightning_dist/callbacks/host_syncs.py counts. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRESETS = ("ddp", "fsdp", "fsdp_shard_grad_op", "fsdp_activation_checkpointing", "fsdp_cpu_offload", "fsdp_tp",
           "hsdp_tp", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_2_offload", "deepspeed_stage_3",
           "deepspeed_stage_3_offload", "fsdp_pp", "fsdp_tp_pp", "fsdp cp 2")
# What a run is, where it is more than `strategy=<preset>` on 2 ranks.
OVERRIDES = {"hsdp_tp": ("strategy=hsdp_tp", "trainer.devices=4", "strategy.data_parallel_replicate_size=2"),
             "fsdp_tp_pp": ("strategy=fsdp_tp_pp", "trainer.devices=4"),
             "fsdp cp 2": ("strategy=fsdp", "strategy.context_parallel_size=2")}
FIRST_LOGGED_STEP = 4  # log_every_n_steps=5: steps 0-3 come before the first logged one


def counted(preset: str, steps: int, out: Path) -> dict:
    run_dir = out / preset.replace(" ", "_")
    command = [sys.executable, str(REPO / "train.py"), "trainer.devices=2", *OVERRIDES.get(preset, (f"strategy={preset}",)),
               f"trainer.max_steps={steps}", "test=false", "callbacks=[default,host_syncs]", f"hydra.run.dir={run_dir}"]
    process = subprocess.run(command, cwd=out, capture_output=True, text=True, timeout=1200,
                             env={**os.environ, "DS_ACCELERATOR": "cpu"})
    if process.returncode:
        raise SystemExit(f"{preset} failed ({process.returncode}):\n{process.stderr[-3000:]}")
    return json.loads((run_dir / "host_syncs.json").read_text())  # rank 0's


def row(preset: str, report: dict) -> str:
    """Reads per quiet step once the first logging window is past; and in that window's quiet steps, where engines
    warm up (once a run)."""
    quiet = set(report["quiet_steps"])
    warm_up = {step for step in quiet if step < FIRST_LOGGED_STEP}
    steady = quiet - warm_up
    syncs = [sync for sync in report["syncs"] if sync["step"] in steady]
    early = [sync for sync in report["syncs"] if sync["step"] in warm_up]
    by_source = Counter(sync["source"] for sync in syncs)
    sources = ", ".join(f"{source} {count / len(steady):g}" for source, count in by_source.items()) or "-"
    return (f"| {preset} | {len(steady)} | {len(syncs) / len(steady):g} | {sources} | {where(syncs)} | {len(early)} "
            f"| {where(early)} |")


def where(syncs: list[dict]) -> str:
    """The functions that asked (the first frame outside torch), with their counts."""
    counts = Counter(sync["where"].split(" <- ")[0].rsplit(":", 1)[0] for sync in syncs)
    return "; ".join(f"{name} ({count})" for name, count in counts.most_common()) or "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("presets", nargs="*", default=list(PRESETS))
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="host_syncs_"))
    try:
        lines = ["| preset | quiet steps from step 4 | reads per quiet step | by source | where (count) | reads in "
                 "steps 0-3 | where (count) |", "|---|---:|---:|---|---|---:|---|"]
        lines += [row(preset, counted(preset, args.steps, out)) for preset in args.presets]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
