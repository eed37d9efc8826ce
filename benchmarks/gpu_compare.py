"""Ours against the engines driven by hand, on one GPU: median step, tokens/s, MFU, CUDA peak against the plan, host
syncs per step, eager and compiled, for ddp, fsdp, fsdp_activation_checkpointing and ZeRO-1/2/3.

    python benchmarks/gpu_compare.py                 # 303.6M GPT, T 1024, batch 8, bf16-mixed, 7 rows: ~7 min, 1 GPU
    python benchmarks/gpu_compare.py --budget 180    # the rows that fit in 3 minutes, in the default order
    python benchmarks/gpu_compare.py --shape 1.3b    # 1.3B GPT, T 2048, batch 8 (most of an 80 GB device), 5 rows
    python benchmarks/gpu_compare.py --rows fsdp_activation_checkpointing fsdp_activation_checkpointing+compile
    python benchmarks/gpu_compare.py --device cpu --shape tiny --steps 6 --rows ddp   # the suite's scaled-down run
    python benchmarks/gpu_compare.py --device cpu --shape host --steps 40   # 24 blocks x 32: the host's time, on CPU

The default rows, most telling first (ddp, fsdp and ZeRO-3 eager: ZeRO-3 against FSDP2 on the same model; then ddp
and fsdp compiled, ZeRO-2 and ZeRO-1), are 14 runs, each 30 timed steps: on one H100 about 25 s a run to start, 5 s
of steps, 30 s more to compile a compiled one. Every row: `--rows`. `--budget SECONDS` starts a row only while its
two runs fit in the time left, judged by the slowest row so far (a compiled row's first: twice that), and the table
and the JSON are written after every row, so a run cut short still leaves the rows it finished.

Each row runs ours (`train.py strategy=<row> trainer.devices=1`, its default callbacks: bar, CSV log, run summary,
training monitor) and the raw loop (benchmarks/raw_loop.py: the same model, data, fused AdamW and engine by hand;
DeepSpeed with the very config ours resolved), alternating which goes first, so that a machine that warms up or
slows down favours neither. Steps are timed by CUDA events (benchmarks/timing.py: the clock never waits for the
device); the median leaves out the first step. After the timed steps ours runs 6 more under `HostSyncs`, which counts
the host reads of each step that neither logs nor refreshes the bar (counting slows every op, so those steps are
not timed). A compiled row (`+compile`) compiles each block, on both sides, and reports torch._dynamo's counters.

A row whose ours/raw is above `--split-above` (1.03) is run once more on each side under cProfile over the same
10 steps (benchmarks/timing.StepCProfile, `raw_loop.py --cprofile`) before the next row, budget allowing: the table
is followed by where each side's host time went (Python, operators, the autograd engine, collectives) and the
functions whose own time ours exceeds raw's by the most (benchmarks/time_split.py), so that a gap found on a lent GPU
comes back explained.

Writes `<out>/gpu_compare.md` (the table) and `<out>/gpu_compare.json` (every figure). No GPU: `--device cpu`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `python benchmarks/gpu_compare.py`, from any directory

from benchmarks.compare_raw import child_pythonpath, engine, machine  # noqa: E402
from benchmarks.time_split import BUCKETS, own_time_gap, rank_file, split  # noqa: E402
from benchmarks.timing import PROFILED_STEPS  # noqa: E402

ROWS = ("ddp", "fsdp", "fsdp_activation_checkpointing", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3")
COMPILED = "+compile"
DEFAULT_ROWS = ("ddp", "fsdp", "deepspeed_stage_3", "ddp+compile", "fsdp+compile", "deepspeed_stage_2",
                "deepspeed_stage_1")
COUNTED_STEPS = 6  # after the timed ones, under HostSyncs: one of them (the 5th) logs


@dataclass(frozen=True)
class Shape:
    n_layer: int
    d_model: int
    n_head: int
    block_size: int  # T
    batch_size: int
    rows: tuple[str, ...] = DEFAULT_ROWS

    @property
    def model(self) -> dict[str, int]:
        return {"n_layer": self.n_layer, "d_model": self.d_model, "n_head": self.n_head}


SHAPES = {
    # The first GPU timings' shape (issue 45): 303.6M parameters.
    "303m": Shape(24, 1024, 16, 1024, 8),
    # 1.31B parameters at T 2048: weights, gradients and AdamW state 21 GB in bf16-mixed, activations most of the rest.
    "1.3b": Shape(26, 2048, 16, 2048, 8, ("ddp", "ddp+compile", "fsdp", "fsdp+compile", "deepspeed_stage_2")),
    "tiny": Shape(2, 64, 2, 64, 4),
    # 303m's 24 blocks with next to no arithmetic: a step that is the host's work (Python, hooks, launches), as the
    # GPU's fsdp row appears to be; what a CPU can say about our host time against raw's.
    "host": Shape(24, 32, 2, 32, 1, ("ddp", "fsdp", "deepspeed_stage_3", "deepspeed_stage_2")),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="303m")
    parser.add_argument("--rows", nargs="*", help=f"presets, of {', '.join(ROWS)}, each with `{COMPILED}` for its "
                        f"compiled row; default: {' '.join(DEFAULT_ROWS)}")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run (the first is left out)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default=None, help="default: bf16-mixed on a GPU, 32-true on a CPU")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gpu_compare")
    parser.add_argument("--budget", type=float, default=None, help="seconds: start no row that would not end in them")
    parser.add_argument("--split-above", type=float, default=1.03,
                        help="profile the rows whose ours/raw is above this (cProfile, both sides), budget allowing")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    precision = args.precision or ("bf16-mixed" if args.device == "cuda" else "32-true")
    rows = args.rows or list(shape.rows)
    unknown = [row for row in rows if row.removesuffix(COMPILED) not in ROWS]
    if unknown:
        parser.error(f"--rows: {', '.join(unknown)} is not a row; choose from {', '.join(ROWS)} (+compile)")
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)

    results: dict[str, dict] = {}
    report = {"machine": machine(), "shape": asdict(shape), "precision": precision, "device": args.device,
              "steps": args.steps, "rows": results, "not_run": [], "time_split": {}}
    started, slowest = time.monotonic(), 0.0
    for index, row in enumerate(rows):
        expected = slowest * (2 if row.endswith(COMPILED) else 1)
        if args.budget is not None and time.monotonic() - started + expected > args.budget:
            report["not_run"] = rows[index:]  # in order of value: what is left is what matters least
            break
        row_started = time.monotonic()
        sides = [("ours", run_ours), ("raw", run_raw)]
        # Alternately first; ours first under DeepSpeed, whose raw loop runs the config ours resolved.
        first_raw = index % 2 and engine(row.removesuffix(COMPILED)) != "deepspeed"
        results[row] = {side: side_run(row, shape, args, precision)
                        for side, side_run in (sides[::-1] if first_raw else sides)}
        results[row]["plan_bytes"] = planned_peak(configured(row, shape, args, precision))
        slowest = max(slowest, time.monotonic() - row_started)
        write(report, shape, args.out)
        # A gap is explained before the next row is measured: its profile is worth more than a row of less value.
        fits = args.budget is None or time.monotonic() - started + slowest <= args.budget
        if ratio(results[row]) > args.split_above and fits:
            report["time_split"][row] = time_split(row, shape, args, precision)
            write(report, shape, args.out)
    table = write(report, shape, args.out)
    print(table)


def ratio(sides: dict) -> float:
    return statistics.median(sides["ours"]["step_s"]) / statistics.median(sides["raw"]["step_s"])


def time_split(row: str, shape: Shape, args: argparse.Namespace, precision: str) -> dict:
    """Both sides of `row` once more, each under cProfile over PROFILED_STEPS: seconds by kind, and the functions
    whose own time ours exceeds raw's by the most."""
    profiled = argparse.Namespace(**{**vars(args), "steps": max(args.steps, PROFILED_STEPS.stop + 1)})
    prefixes = {side: args.out / f"cprofile_{side}_{row}.prof" for side in ("ours", "raw")}
    run_ours(row, shape, profiled, precision, cprofile=prefixes["ours"])
    run_raw(row, shape, profiled, precision, cprofile=prefixes["raw"])
    files = {side: rank_file(prefix, 0) for side, prefix in prefixes.items()}
    return {**{side: split(path)[0] for side, path in files.items()},
            "gap": own_time_gap(files["ours"], files["raw"])}


def write(report: dict, shape: Shape, out: Path) -> str:
    (out / "gpu_compare.json").write_text(json.dumps(report, indent=1))
    table = markdown(report, shape)
    (out / "gpu_compare.md").write_text(table + "\n")
    return table


def configured(row: str, shape: Shape, args: argparse.Namespace, precision: str) -> list[str]:
    """train.py's overrides for this row: the run, as the plan sees it too."""
    return [
        f"strategy={row.removesuffix(COMPILED)}", *(f"model.{key}={value}" for key, value in shape.model.items()),
        f"data.block_size={shape.block_size}", f"data.batch_size={shape.batch_size}",
        f"trainer.max_steps={args.steps + COUNTED_STEPS}", f"trainer.accelerator={args.device}", "trainer.devices=1",
        f"trainer.precision={precision}", f"compile={str(row.endswith(COMPILED)).lower()}",
        "test=false", "trainer.limit_val_batches=0", "trainer.num_sanity_val_steps=0",
    ]


def run_ours(row: str, shape: Shape, args: argparse.Namespace, precision: str, cprofile: Path | None = None) -> dict:
    run_dir = args.out / (f"ours_{row}" if cprofile is None else f"ours_{row}_cprofile")
    command = [
        sys.executable, str(REPO / "train.py"), *configured(row, shape, args, precision), f"hydra.run.dir={run_dir}",
        "+callbacks.iteration_timer._target_=benchmarks.timing.IterationTimer",
        f"+callbacks.iteration_timer.path={run_dir}/iterations.json",
        "+callbacks.host_syncs._target_=lightning_dist.callbacks.HostSyncs",
        f"+callbacks.host_syncs.path={run_dir}/host_syncs.json", f"+callbacks.host_syncs.from_step={args.steps}",
        "+callbacks.dynamo._target_=benchmarks.timing.DynamoCounters", f"+callbacks.dynamo.path={run_dir}/dynamo.json",
    ]
    if cprofile is not None:
        command += ["+callbacks.cprofile._target_=benchmarks.timing.StepCProfile", f"+callbacks.cprofile.path={cprofile}"]
    run(command, args.device)
    summary = json.loads((run_dir / "metrics.json").read_text())
    syncs = json.loads((run_dir / "host_syncs.json").read_text())
    quiet = len(syncs["quiet_steps"])
    return {
        "step_s": json.loads((run_dir / "iterations_rank0.json").read_text())[1:args.steps],
        "peak_bytes": summary["peak_memory_per_rank"][0]["bytes"],
        "host_syncs_per_quiet_step": syncs["syncs_in_quiet_steps"] / quiet if quiet else None,
        "dynamo": json.loads((run_dir / "dynamo.json").read_text()),
    }


def run_raw(row: str, shape: Shape, args: argparse.Namespace, precision: str, cprofile: Path | None = None) -> dict:
    result = args.out / (f"raw_{row}.json" if cprofile is None else f"raw_{row}_cprofile.json")
    preset = row.removesuffix(COMPILED)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               str(REPO / "benchmarks" / "raw_loop.py"), "--strategy", engine(preset), "--steps", str(args.steps),
               "--batch-size", str(shape.batch_size), "--block-size", str(shape.block_size), "--device", args.device,
               "--precision", precision, "--out", str(result),
               "--model", *(f"{key}={value}" for key, value in shape.model.items())]
    if preset == "fsdp_activation_checkpointing":
        command.append("--activation-checkpointing")
    if row.endswith(COMPILED):
        command.append("--compile")
    if engine(preset) == "deepspeed":  # the config ours ran with (its compiled twin's is the same)
        command += ["--deepspeed-config", str(args.out / f"ours_{row}" / "deepspeed_config.effective.json")]
    if cprofile is not None:
        command += ["--cprofile", str(cprofile)]
    run(command, args.device)
    rank = json.loads(result.read_text())[0]
    return {"step_s": rank["iteration_s"][1:], "peak_bytes": rank["cuda_peak"] or rank["peak_rss"],
            "dynamo": rank["dynamo"]}


def run(command: list[str], device: str) -> None:
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "PYTHONWARNINGS": "ignore"}
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    process = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if process.returncode:
        raise SystemExit(f"failed ({process.returncode}): {' '.join(command)}\n{process.stderr[-3000:]}")


def planned_peak(overrides: list[str]) -> float:
    """What `train.py <overrides> plan=true` plans for one device: model state, activations, buffers (bytes)."""
    from hydra import compose, initialize_config_dir

    from lightning_dist.memory import layout_of, plan_memory
    from lightning_dist.run.compose import compose as compose_run

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    run = compose_run(cfg)
    return plan_memory(run.facts(), layout_of(run.strategy, run.strategy_name), cfg.trainer.precision).device_total


def markdown(report: dict, shape: Shape) -> str:
    from lightning_dist.models.gpt import GPT
    from lightning_dist.reports.flops import ModelFlops

    tokens = shape.batch_size * shape.block_size
    with torch.device("meta"):
        model = GPT(vocab_size=256, block_size=shape.block_size, dropout=0.0, **shape.model)
    flops_per_token = ModelFlops.of(model).per_token(shape.block_size)  # as the training monitor counts them
    peak = peak_flops(report["device"], report["precision"])
    lines = [f"{report['machine']}; {report['device']}, {report['precision']}, GPT {shape.n_layer} layers x "
             f"{shape.d_model}, T {shape.block_size}, batch {shape.batch_size}, {report['steps']} steps per run", "",
             "| row | ours step (ms) | raw step (ms) | ours/raw | ours tokens/s | raw tokens/s | ours MFU | "
             "ours peak GB | raw peak GB | plan GB | plan/ours peak | host syncs per quiet step | graphs, breaks |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row, sides in report["rows"].items():
        ours, raw = (statistics.median(sides[side]["step_s"]) for side in ("ours", "raw"))
        mfu = f"{tokens / ours * flops_per_token / peak:.1%}" if peak else "?"
        counted = sides["ours"]["host_syncs_per_quiet_step"]
        compiled = "; ".join(f"{side} {dynamo[-1]['unique_graphs']}, {dynamo[-1]['graph_breaks']}"
                             for side in ("ours", "raw") if (dynamo := sides[side]["dynamo"]) and row.endswith(COMPILED))
        lines.append(
            f"| {row} | {ours * 1e3:.1f} | {raw * 1e3:.1f} | {ours / raw:.3f} | {tokens / ours:,.0f} | {tokens / raw:,.0f}"
            f" | {mfu} | {sides['ours']['peak_bytes'] / 1e9:.2f} | {sides['raw']['peak_bytes'] / 1e9:.2f}"
            f" | {sides['plan_bytes'] / 1e9:.2f} | {sides['plan_bytes'] / sides['ours']['peak_bytes']:.2f}"
            f" | {'?' if counted is None else f'{counted:g}'} | {compiled or '-'} |")
    rows = report["rows"]
    if "fsdp" in rows and "deepspeed_stage_3" in rows:  # the two ways to shard everything, on the same model
        fsdp, zero3 = (statistics.median(rows[row]["ours"]["step_s"]) for row in ("fsdp", "deepspeed_stage_3"))
        lines += ["", f"ZeRO-3 against FSDP2, ours: {zero3 * 1e3:.1f} ms against {fsdp * 1e3:.1f} ms a step"
                      f" ({zero3 / fsdp:.3f}x)."]
    if report.get("not_run"):
        lines += ["", f"Not run, past the time budget: {', '.join(report['not_run'])}."]
    for row, found in report.get("time_split", {}).items():
        lines += ["", f"Where {row}'s host time went, rank 0, steps {PROFILED_STEPS.start}-{PROFILED_STEPS.stop - 1}"
                      " under cProfile (seconds):", "",
                  "| side | " + " | ".join(BUCKETS) + " |", "|---|" + "---:|" * len(BUCKETS)]
        lines += [f"| {side} | " + " | ".join(f"{found[side][name]:.3f}" for name in BUCKETS) + " |"
                  for side in ("ours", "raw")]
        lines += ["", "Own time ours spent beyond raw's: "
                  + "; ".join(f"{name} {gap:+.3f} s" for gap, name in found["gap"]) + "."]
    return "\n".join(lines)


def peak_flops(device: str, precision: str) -> float | None:
    from lightning_dist.reports.flops import device_peak_flops

    found = device_peak_flops(torch.device(device), precision)
    return found[0] if found else None


if __name__ == "__main__":
    main()
