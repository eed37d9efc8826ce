"""Ours against the same engine driven by hand: median iteration time, throughput and peak memory per rank.

    python benchmarks/compare_raw.py                                  # every row of every model (about 60 min)
    python benchmarks/compare_raw.py --models gpt_tiny --repeats 3 ddp fsdp
    python benchmarks/compare_raw.py --models gpt_medium_pp gpt_medium_cp   # the pipeline and context rows

Runs alternate (ours, raw, then raw, ours, ...), so a machine that slows down over time favours neither side. Both
sides train the same model on the same data with the same AdamW, 2 CPU ranks (fsdp_tp: 4, 2 data-parallel x 2
tensor-parallel): the default model (tiny GPT, 0.84M parameters, batch 16 x 128 per data-parallel rank) and
gpt_medium (57M parameters, batch 2 x 128 per data-parallel rank, where the framework's share of an iteration is
smaller). The parallel axes on gpt_medium, 4 ranks each (2 data-parallel): pipeline stages under GPipe, 1F1B and
Interleaved1F1B (`fsdp_pp:<schedule>`, batch 4: a microbatch per stage) against torch's own pipelining loop, and
context parallelism over 2 ranks at 1,024 tokens (`fsdp:cp2`) against Ulysses written out (raw_loop.py says how
each is built). DeepSpeed's raw loop uses the very config our strategy resolved. Our side is
`train.py` as users run it: progress bar, CSV logging, the run summary and the training monitor (with its per-step
NaN check) all on.

A row named `<strategy>+compile` is ours with `compile=true` (each block compiled) against the same raw eager loop.
Its compile time, summed over the graphs rank 0 compiles, is reported cold (the first run, with an empty inductor
cache of the benchmark's own) and warm (later runs, which read that cache).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WARMUP = 3  # iterations left out of the median: allocation, JIT, first collectives
STRATEGIES = ("ddp", "fsdp", "fsdp_activation_checkpointing", "fsdp_cpu_offload", "deepspeed_stage_1",
              "deepspeed_stage_2", "deepspeed_stage_2_offload", "deepspeed_stage_3", "deepspeed_stage_3_offload")
RAW_FLAGS = {"fsdp_activation_checkpointing": ["--activation-checkpointing"], "fsdp_cpu_offload": ["--cpu-offload"],
             "fsdp_tp": ["--tensor-parallel", "2"]}
# The axes' rows, `<preset>:<what>`: our overrides and the raw loop's flags for the same layout.
PIPELINE = ("--pipeline-parallel", "2", "--pipeline-schedule")
AXIS_ROWS = {
    "fsdp_pp:GPipe": (("strategy.pipeline_schedule=GPipe",), (*PIPELINE, "GPipe")),
    "fsdp_pp:1F1B": (("strategy.pipeline_schedule=1F1B",), (*PIPELINE, "1F1B")),
    "fsdp_pp:Interleaved1F1B": (("strategy.pipeline_schedule=Interleaved1F1B", "strategy.stages_per_rank=2"),
                                (*PIPELINE, "Interleaved1F1B", "--stages-per-rank", "2")),
    "fsdp:cp2": (("strategy.context_parallel_size=2",), ("--context-parallel", "2")),
}
# Ranks a row runs on (2 unless named): 2 data-parallel ranks in every row (x 2 tensor-parallel, pipeline or context
# ranks in the 4-rank rows), so samples per iteration are the same.
DEVICES = {"fsdp_tp": 4, **{row: 4 for row in AXIS_ROWS}}
COMPILED = "+compile"  # a row's suffix: ours with compile=true
COMPILE_LINE = re.compile(r"torch\.compile: compiled \d+ graphs? in ([\d.]+) s")
INDUCTOR_CACHE = "inductor_cache"  # under --out: TORCHINDUCTOR_CACHE_DIR of the benchmark's own, emptied at its start


def devices(strategy: str) -> int:
    return DEVICES.get(strategy.removesuffix(COMPILED), DEVICES.get(preset(strategy), 2))


def preset(row: str) -> str:
    return row.removesuffix(COMPILED).split(":")[0]


def raw_flags(row: str) -> list[str]:
    return [*RAW_FLAGS.get(preset(row), []), *AXIS_ROWS.get(row.removesuffix(COMPILED), ((), ()))[1]]


def our_overrides(row: str) -> tuple[str, ...]:
    return AXIS_ROWS.get(row.removesuffix(COMPILED), ((), ()))[0]


@dataclass(frozen=True)
class Model:
    overrides: tuple[str, ...]  # train.py's
    hyper_parameters: tuple[str, ...]  # raw_loop.py's --model, the same values
    batch_size: int
    steps: int
    strategies: tuple[str, ...] = STRATEGIES  # the default rows
    block_size: int = 128  # tokens a sample, data.block_size


MEDIUM = ("n_layer=8", "d_model=768", "n_head=12", "lr=3e-4")  # gpt_medium's, as raw_loop.py's --model
MODELS = {
    "gpt_tiny": Model((), (), batch_size=16, steps=40),
    # Seconds a step on 2 CPU cores: the engines the targets name, in 10 steps a run.
    "gpt_medium": Model(("model=gpt_medium", "data.batch_size=2"), MEDIUM, batch_size=2, steps=10,
                        strategies=("ddp", "fsdp", "fsdp_tp", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3",
                                    "ddp+compile", "fsdp+compile")),
    "gpt_medium_pp": Model(("model=gpt_medium", "data.batch_size=4"), MEDIUM, batch_size=4, steps=10,
                           strategies=("fsdp_pp:GPipe", "fsdp_pp:1F1B", "fsdp_pp:Interleaved1F1B")),
    "gpt_medium_cp": Model(("model=gpt_medium", "data.batch_size=2", "data.block_size=1024"), MEDIUM, batch_size=2,
                           steps=10, strategies=("fsdp:cp2",), block_size=1024),
}


def engine(strategy: str) -> str:
    strategy = preset(strategy)
    return "deepspeed" if strategy.startswith("deepspeed") else "fsdp" if strategy.startswith("fsdp") else "ddp"


def run_ours(strategy: str, model: Model, out: Path) -> dict:
    run_dir = out / f"ours_{strategy.replace(':', '_')}"
    # This benchmark's earlier result, replaced on purpose: train.py refuses a run directory that holds a run.
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [
        sys.executable, str(REPO / "train.py"), f"strategy={preset(strategy)}", *model.overrides,
        *our_overrides(strategy),
        f"trainer.max_steps={model.steps}", f"compile={str(strategy.endswith(COMPILED)).lower()}",
        f"trainer.devices={devices(strategy)}",
        "test=false", "trainer.limit_val_batches=0", "trainer.num_sanity_val_steps=0", f"hydra.run.dir={run_dir}",
        "+callbacks.iteration_timer._target_=benchmarks.timing.IterationTimer",
        f"+callbacks.iteration_timer.path={run_dir}/iterations.json",
    ]
    # A cache of each row's own: ddp's compiled blocks would otherwise make fsdp's first compilation warm.
    _run(command, TORCHINDUCTOR_CACHE_DIR=str(out.parent / INDUCTOR_CACHE / f"{out.name}_{strategy}"))
    iterations = [json.loads((run_dir / f"iterations_rank{r}.json").read_text()) for r in range(devices(strategy))]
    peaks = [rank["bytes"] for rank in json.loads((run_dir / "metrics.json").read_text())["peak_memory_per_rank"]]
    compile_s = sum(float(seconds) for seconds in COMPILE_LINE.findall((run_dir / "train.log").read_text()))
    return {"iterations": iterations, "peaks": peaks, "compile_s": compile_s}


def run_raw(strategy: str, model: Model, out: Path) -> dict:
    result = out / f"raw_{strategy.replace(':', '_')}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(devices(strategy)),
               str(REPO / "benchmarks" / "raw_loop.py"), "--strategy", engine(strategy), "--steps", str(model.steps),
               "--batch-size", str(model.batch_size), "--block-size", str(model.block_size), "--out", str(result),
               *raw_flags(strategy)]
    if model.hyper_parameters:
        command += ["--model", *model.hyper_parameters]
    if engine(strategy) == "deepspeed":
        resolved = out / f"ours_{strategy.replace(':', '_')}" / "deepspeed_config.effective.json"
        command += ["--deepspeed-config", str(resolved)]
    _run(command)
    ranks = json.loads(result.read_text())
    return {"iterations": [rank["iteration_s"] for rank in ranks], "peaks": [rank["peak_rss"] for rank in ranks]}


def child_pythonpath() -> str:
    """This checkout first, then the caller's path: where packages were installed with `--target` (a lent GPU machine
    lacks deepspeed and Hydra, scripts/gpu_check.sh), the runs import them from there."""
    return os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def _run(command: list[str], **env: str) -> None:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": child_pythonpath(), "PYTHONWARNINGS": "ignore", **env}
    process = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if process.returncode:
        raise SystemExit(f"failed ({process.returncode}): {' '.join(command)}\n{process.stderr[-3000:]}")


def median_iteration(runs: list[dict]) -> float:
    # The slower rank sets the pace of a synchronous step: per iteration, the max over ranks.
    per_run = [[max(times) for times in zip(*run["iterations"])][WARMUP:] for run in runs]
    return statistics.median(t for times in per_run for t in times)


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import deepspeed
    import lightning
    import torch

    return (f"{cpu}, {os.cpu_count()} cores, {memory_gib:.0f} GiB; Python {platform.python_version()}, torch "
            f"{torch.__version__}, Lightning {lightning.__version__}, DeepSpeed {deepspeed.__version__}")


def table(name: str, model: Model, results: dict[str, dict[str, list[dict]]]) -> tuple[str, dict]:
    samples = 2 * model.batch_size  # per iteration, over the 2 data-parallel ranks of every row
    lines = [f"{name}, batch {model.batch_size} x {model.block_size} per data-parallel rank:", "",
             "| strategy | ours median iteration (ms) | raw (ms) | ours/raw | ours samples/s | raw samples/s | "
             "ours peak RSS per rank (MB) | raw (MB) | ours/raw |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    summary = {}
    for strategy, sides in results.items():
        ours, raw = median_iteration(sides["ours"]), median_iteration(sides["raw"])
        peak = {side: max(max(run["peaks"]) for run in sides[side]) / 1e6 for side in sides}
        summary[strategy] = {"ours_s": ours, "raw_s": raw, "ratio": ours / raw, "peak_mb": peak}
        lines.append(f"| {strategy} | {ours * 1e3:.1f} | {raw * 1e3:.1f} | {ours / raw:.3f} | {samples / ours:.1f} | "
                     f"{samples / raw:.1f} | {peak['ours']:.0f} | {peak['raw']:.0f} | {peak['ours'] / peak['raw']:.3f} |")
    compiled = {row: [run["compile_s"] for run in sides["ours"]]
                for row, sides in results.items() if row.endswith(COMPILED)}
    if compiled:
        lines += ["", "| compiled row | raw/ours (speed-up) | compile time, cold (s) | warm (s) |", "|---|---:|---:|---:|"]
        for row, seconds in compiled.items():
            summary[row]["compile_s"] = seconds
            warm = f"{statistics.median(seconds[1:]):.1f}" if len(seconds) > 1 else "-"
            lines.append(f"| {row} | {1 / summary[row]['ratio']:.2f}x | {seconds[0]:.1f} | {warm} |")
    return "\n".join(lines), summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("strategies", nargs="*", help="default: each model's rows (MODELS)")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "compare_raw")
    args = parser.parse_args()

    print(f"Machine: {machine()}", flush=True)
    shutil.rmtree(args.out / INDUCTOR_CACHE, ignore_errors=True)  # each compiled row's first run compiles cold
    report, summary = [], {}
    for name in args.models:
        model, out = MODELS[name], args.out / name
        out.mkdir(parents=True, exist_ok=True)
        strategies = args.strategies or model.strategies
        results = {strategy: {"ours": [], "raw": []} for strategy in strategies}
        for repeat in range(args.repeats):
            for strategy in strategies:
                # Ours first on even repeats (its DeepSpeed config feeds the raw loop), raw first on odd ones.
                for side in ("ours", "raw") if repeat % 2 == 0 else ("raw", "ours"):
                    runner = run_ours if side == "ours" else run_raw
                    results[strategy][side].append(runner(strategy, model, out))
                    print(f"{name} repeat {repeat + 1}/{args.repeats}: {strategy} {side} done", flush=True)
        text, summary[name] = table(name, model, results)
        report.append(text)
        print("\n" + text + "\n", flush=True)
    print("\n\n".join(report))
    (args.out / "compare_raw.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
