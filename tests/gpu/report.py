"""Render what scripts/gpu_check.sh measured as its Markdown report: the GPU suite's figures ($LD_GPU_MEASUREMENTS),
and from its work directory ours against the raw loops (benchmarks/gpu_compare.py's table) and the parallel axes'
runs across devices, and the parts that failed or ran past their limits.

    python -m tests.gpu.report MEASUREMENTS.json REPORT.md PYTEST_SUMMARY_LINE [WORK_DIR [FAILED_PARTS]]
"""

from __future__ import annotations

import csv
import importlib.metadata
import json
import os
import sys
from pathlib import Path


def render(measured: dict, versions: dict[str, str], summary: str) -> str:
    lines = ["# GPU check", "", "What `bash scripts/gpu_check.sh` measured on its last run (it rewrites this file).", "",
             "| | |", "|---|---|", *(f"| {key} | {value} |" for key, value in versions.items()),
             f"| pytest | {summary} |", "", "## Every preset, 20 steps, fp32, world size 1 (nccl), then the test loop", "",
             "| preset | final loss | val loss | test loss | max relative gap vs ddp | peak CUDA memory (MB) |"
             " median step (ms) | parameters on |",
             "|---|---|---|---|---|---|---|---|"]
    for name, row in sorted(measured.get("fp32", {}).items()):
        gap = "reference" if name == "ddp" else _number(row.get("max_relative_gap_vs_ddp"), "{:.2e}")
        lines.append(
            f"| {name} | {_number(row.get('final_loss'), '{:.6f}')} | {_number(row.get('val_loss'), '{:.4f}')}"
            f" | {_number(row.get('test_loss'), '{:.4f}')} | {gap} | {_number(row.get('peak_cuda_bytes'), '{:.1f}', 2**-20)}"
            f" | {_number(row.get('median_step_time_s'), '{:.1f}', 1e3)} | {', '.join(row.get('placement', [])) or '-'} |"
        )
    lines += ["", "## Mixed precision, 10 steps", "", "| preset | precision | final loss | stored parameters | peak CUDA memory (MB) |", "|---|---|---|---|---|"]
    for cell, row in sorted(measured.get("precision", {}).items()):
        name, precision = cell.split("|")
        lines.append(f"| {name} | {precision} | {row['final_loss']:.4f} | {', '.join(row['parameter_dtypes'])} | {row['peak_cuda_bytes'] / 2**20:.1f} |")
    lines += ["", "## Resumed at step 10 (fp32), against the uninterrupted run", "", "| preset | max relative gap |", "|---|---|"]
    for name, row in sorted(measured.get("resume", {}).items()):
        lines.append(f"| {name} | {row['max_relative_gap']:.2e} |")
    lines += ["", "## The last checkpoint consolidated, loaded in a plain process (no GPU process group)", "",
              "| preset | plain load |", "|---|---|"]
    lines += [f"| {name} | {outcome} |" for name, outcome in sorted(measured.get("consolidated", {}).items())]
    lines += ["", "## Tensor parallelism on 2 GPUs, 10 steps (where 2 are visible)", "",
              "| preset | final loss | val loss | peak CUDA memory (MB) |", "|---|---|---|---|"]
    for name, row in sorted(measured.get("tensor_parallel", {}).items()):
        lines.append(f"| {name} | {row['final_loss']:.4f} | {row['val_loss']:.4f} | {row['peak_cuda_bytes'] / 2**20:.1f} |")
    if not measured.get("tensor_parallel"):
        lines.append("| (fewer than 2 GPUs visible: not run) | | | |")
    qlora = measured.get("qlora")
    lines += ["", "## QLoRA (a 4-bit NF4 base, LoRA), 3 steps", "",
              "| strategy | float32 storage, 32-true | bf16 storage, bf16-mixed |", "|---|---|---|"]
    for strategy, places in (qlora or {}).get("losses", {}).items():
        lines.append(f"| {strategy} | " + " | ".join(", ".join(f"{loss:.4f}" for loss in places[place])
                                                    for place in ("qlora", "qlora_bf16")) + " |")
    lines.append(f"\nThe 4-bit model's first loss in one plain process: {qlora['plain_first_loss']:.4f}" if qlora
                 else "| (not run: bitsandbytes missing, scripts/gpu_wheels.sh hf) | | |")
    return "\n".join(lines) + "\n"


def render_parts(work: Path, failed: str) -> str:
    """The sections of the script's later parts: the raw-loop table, the axes' runs, and what failed."""
    table = work / "compare" / "gpu_compare.md"
    lines = ["", "## Ours against the raw loops (benchmarks/gpu_compare.py)", "",
             table.read_text().strip() if table.exists() else "(not run)", "",
             "## Tensor, pipeline and context parallelism on 2 devices, beside ddp on 1 (20 steps, the same batches)", "",
             "| layout | final loss | max relative gap vs ddp | median step (ms) |", "|---|---|---|---|"]
    runs = {run.name: run for run in sorted((work / "axes").glob("*")) if (run / "metrics.json").exists()}
    reference = _losses(runs["ddp"]) if "ddp" in runs else {}
    for name, run in runs.items():
        losses, summary = _losses(run), json.loads((run / "metrics.json").read_text())
        gaps = [abs(losses[step] - loss) / abs(loss) for step, loss in reference.items() if step in losses]
        gap = "reference" if name == "ddp" else f"{max(gaps):.2e}" if gaps else "-"
        step_s = summary.get("median_step_time_s")
        lines.append(f"| {name} | {losses[max(losses)]:.4f} | {gap} | {_number(step_s, '{:.1f}', 1e3)} |")
    if not runs:
        lines.append("| (not run: fewer than 2 devices) | | | |")
    lines += ["", "## Parts", "", f"Failed or past their limits: {failed}." if failed else
              "Every part ended within its limit."]
    return "\n".join(lines) + "\n"


def _losses(run: Path) -> dict[int, float]:
    with open(run / "csv" / "metrics.csv") as handle:
        return {int(row["step"]): float(row["train_loss"]) for row in csv.DictReader(handle) if row.get("train_loss")}


def _number(value: float | None, form: str, scale: float = 1.0) -> str:
    return "-" if value is None else form.format(value * scale)


def _driver() -> str:
    import subprocess

    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.splitlines()[0].strip()
    except (OSError, IndexError, subprocess.SubprocessError):
        return "unknown"


def versions() -> dict[str, str]:
    import lightning
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    found = {"GPU": f"{visible} x {torch.cuda.get_device_name(0)}" if visible else "none",
             "driver": _driver(), "torch": torch.__version__, "CUDA": str(torch.version.cuda),
             "lightning": lightning.__version__}
    try:  # read, not imported: on the H200 of 2026-12-04 the report's process hung at exit after DeepSpeed's import
        found["deepspeed"] = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        found["deepspeed"] = "missing"
    found["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-"
    return found


if __name__ == "__main__":
    path, output, summary = sys.argv[1:4]
    text = open(path).read() if os.path.exists(path) else ""
    measured = json.loads(text) if text.strip() else {}  # empty: the suite stopped before writing, or did not run
    report = render(measured, versions(), summary)
    if len(sys.argv) > 4:
        report += render_parts(Path(sys.argv[4]), sys.argv[5] if len(sys.argv) > 5 else "")
    with open(output, "w") as handle:
        handle.write(report)
