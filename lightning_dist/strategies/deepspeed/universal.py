"""DeepSpeed checkpoints at another world size: converted to DeepSpeed's universal format, which its engine
re-partitions (weights and Adam state, per parameter) for any number of ranks.

The conversion (`deepspeed.checkpoint.ds_to_universal`) runs once, on demand, and lives inside the checkpoint
directory beside the tag it was made from (`<tag>_universal` and `latest_universal`): nothing saved is changed.

    python -m lightning_dist.strategies.deepspeed.universal CHECKPOINT_DIR     # ahead of time, e.g. on a login node
"""

from __future__ import annotations

import argparse
import shutil
import sys
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import torch

from lightning_dist._compat.deepspeed import universal_checkpoint_loading
from lightning_dist.checkpoints.formats import (
    DEEPSPEED,
    CheckpointError,
    command_exit,
    deepspeed_tag_dir,
)
from lightning_dist.checkpoints.ranks import Ranks
from lightning_dist.checkpoints.safe_load import load_file
from lightning_dist.checkpoints.source import CheckpointSource
from lightning_dist.checkpoints.universal_form import convert_to_universal

LATEST_UNIVERSAL = "latest_universal"  # written last by ds_to_universal: its presence means a finished conversion


def saved_run(source: CheckpointSource) -> tuple[int | None, dict[str, Any]]:
    """The number of data-parallel ranks that wrote the DeepSpeed checkpoint `source` (None if it does not say)
    and the DeepSpeed config they ran with ({} if absent)."""
    model_states = sorted(deepspeed_tag_dir(source.path).glob("*model_states.pt"))
    saved = load_file(model_states[0], mmap=True, trusted=source.readable)
    return saved.get("dp_world_size"), saved.get("ds_config") or {}


def saved_adam_moments(source: CheckpointSource) -> bool:
    """Whether the optimizer of the DeepSpeed checkpoint `source` kept Adam's moments: DeepSpeed's universal
    converter reads them for every parameter (an SGD run's conversion failed with `KeyError: 0`)."""
    optimizer_files = sorted(deepspeed_tag_dir(source.path).glob("*optim_states.pt"))
    if not optimizer_files:
        return False
    saved = load_file(optimizer_files[0], mmap=True, trusted=source.readable)["optimizer_state_dict"]
    base = saved.get("base_optimizer_state") or saved.get("optimizer_state_dict") or {}  # ZeRO-1/2, ZeRO-3
    states = list(base.get("state", {}).values())
    return bool(states) and all("exp_avg" in state for state in states)


def ensure_universal(path: str | Path | CheckpointSource) -> Path:
    """The universal form of the DeepSpeed checkpoint at `path`, made now unless an earlier conversion finished."""
    source = CheckpointSource.of(path)
    path = source.path
    if source.format != DEEPSPEED:
        raise CheckpointError(
            f"ckpt_path: {path} is not a DeepSpeed checkpoint directory; only those convert to universal"
        )
    tag_dir = deepspeed_tag_dir(path)
    output = tag_dir.with_name(f"{tag_dir.name}_universal")
    if (path / LATEST_UNIVERSAL).is_file() and (path / LATEST_UNIVERSAL).read_text().strip() == output.name:
        return output
    if output.exists():
        shutil.rmtree(output)  # a conversion that was cut off
    convert_to_universal(tag_dir, output)
    if not (path / LATEST_UNIVERSAL).is_file():
        raise CheckpointError(f"ckpt_path: DeepSpeed could not convert {path} to its universal format: it wrote no"
                              f" {LATEST_UNIVERSAL}")
    return output


def convert_on_rank_zero(strategy: Ranks, path: str | Path) -> None:
    """Global rank 0 converts (`ensure_universal`); every rank returns once it is done, or raises its error."""
    failure = None
    if strategy.is_global_zero:
        try:
            ensure_universal(path)
        except CheckpointError as error:
            failure = str(error)
    failure = strategy.broadcast(failure)  # also the other ranks' wait for the conversion
    if failure:
        raise CheckpointError(failure)


@contextmanager
def loading_universal(engine: Any, path: str | Path) -> Iterator[None]:
    """The DeepSpeed engine loads the universal form of `path` (tag `latest_universal`) within; saves stay regular."""
    with universal_checkpoint_loading(engine):
        yield
    if engine.zero_optimization_stage() == 3 and engine.optimizer is not None:
        _repair_zero3_load(engine.optimizer.optimizer, Path(path))


def _repair_zero3_load(optimizer: Any, path: Path) -> None:
    """Undo two slips of DeepSpeed's ZeRO-3 universal loader (0.19): it gives every parameter group the first
    group's hyper-parameters (a no-decay group of biases and norms would start decaying), and one `step` tensor
    to all groups, which Adam then advances once per group and step (bias correction drifts)."""
    universal = path / (path / LATEST_UNIVERSAL).read_text().strip()
    saved = load_file(universal / "zero" / "optimizer_state.pt")["optimizer_state_dict"]["param_groups"]
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(
            f"ckpt_path: {path} has {len(saved)} optimizer parameter groups and this optimizer has"
            f" {len(optimizer.param_groups)}; resume with the optimizer the checkpoint was saved with"
        )
    for group, saved_group in zip(optimizer.param_groups, saved):
        group.update({key: value for key, value in saved_group.items() if key != "params"})
    for state in optimizer.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Convert a DeepSpeed checkpoint to DeepSpeed's universal format, in place."
    )
    parser.add_argument("checkpoint", type=Path, help="a DeepSpeed checkpoint directory (with a 'latest' file)")
    args = parser.parse_args(argv)
    return command_exit(partial(ensure_universal, args.checkpoint), "Universal checkpoint: ")


if __name__ == "__main__":
    sys.exit(main())
