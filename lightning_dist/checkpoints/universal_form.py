"""DeepSpeed's universal checkpoint form: each parameter whole, in a folder of its own with its Adam moments, made
by DeepSpeed's own converter (`deepspeed.checkpoint.ds_to_universal`), which knows every layout DeepSpeed saves
(ZeRO's partitions, AutoEP's experts spread over an expert-parallel group)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from lightning_dist.checkpoints.formats import CheckpointError
from lightning_dist.checkpoints.safe_load import load_file


def convert_to_universal(tag_dir: Path, output: Path, key: str = "ckpt_path") -> None:
    """The universal form of the DeepSpeed checkpoint in `tag_dir`, written to `output`; CheckpointError naming
    `key` with the converter's last line where it fails."""
    # In a process of its own: the converter forks worker processes, and forking a training rank (gloo's and BLAS's
    # threads holding locks) can deadlock them. Our models carry no Megatron-style `universal_checkpoint_info`:
    # DeepSpeed injects the plain default.
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag_dir),
               "--output_folder", str(output), "--inject_missing_state"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode or not (output / "zero").is_dir():
        last_line = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
        raise CheckpointError(
            f"{key}: DeepSpeed could not convert {tag_dir.parent} to its universal format: {last_line}")


def universal_parameters(output: Path) -> dict[str, dict[str, torch.Tensor]]:
    """{parameter name: {"fp32": weights, "exp_avg": ..., "exp_avg_sq": ...}} of a universal form at `output`. ZeRO
    keeps a parameter flat (its shape is in the model-states file); AutoEP's experts come whole, with their shape."""
    found = {}
    for folder in sorted(p for p in (output / "zero").iterdir() if p.is_dir()):
        saved = {file.stem: load_file(file, trusted=True) for file in folder.glob("*.pt")}  # written just now by us
        found[folder.name] = {kind: value["param"] if isinstance(value, dict) else value
                              for kind, value in saved.items() if kind in ("fp32", "exp_avg", "exp_avg_sq")}
    return found


def saved_adam_step(output: Path) -> torch.Tensor | None:
    """The optimizer's step count a universal form at `output` carries (None for an optimizer without one)."""
    state = load_file(output / "zero" / "optimizer_state.pt", trusted=True)["optimizer_state_dict"].get("state") or {}
    step = next((entry.get("step") for entry in state.values() if isinstance(entry, dict)), None)
    return None if step is None else torch.as_tensor(step, dtype=torch.float32, device="cpu").clone()
