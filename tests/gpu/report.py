"""Render what the GPU suite measured ($LD_GPU_MEASUREMENTS) as the Markdown report of scripts/gpu_check.sh.

    python -m tests.gpu.report MEASUREMENTS.json REPORT.md PYTEST_SUMMARY_LINE
"""

from __future__ import annotations

import json
import os
import sys


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
    lines += ["", "## QLoRA (a 4-bit NF4 base, LoRA) under ld_ddp, 3 steps", "",
              "| losses | the 4-bit model's first loss in one plain process |", "|---|---|",
              f"| {', '.join(f'{loss:.4f}' for loss in qlora['losses'])} | {qlora['plain_first_loss']:.4f} |" if qlora
              else "| (not run: bitsandbytes missing, scripts/gpu_wheels.sh hf) | |"]
    return "\n".join(lines) + "\n"


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
    try:
        import deepspeed

        found["deepspeed"] = deepspeed.__version__
    except ImportError:
        found["deepspeed"] = "missing"
    found["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-"
    return found


if __name__ == "__main__":
    path, output, summary = sys.argv[1], sys.argv[2], " ".join(sys.argv[3:])
    text = open(path).read() if os.path.exists(path) else ""
    measured = json.loads(text) if text.strip() else {}  # empty: the suite stopped before writing
    report = render(measured, versions(), summary)  # DeepSpeed's import logs to stdout: the report goes to a file
    with open(output, "w") as handle:
        handle.write(report)
