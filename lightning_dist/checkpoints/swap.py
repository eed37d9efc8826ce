"""Checkpoint directories written beside their final name and swapped in only when complete."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any


def partial_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.partial")


def write_then_swap(strategy: Any, final: str | Path, write: Callable[[Path], None]) -> None:
    """Every rank writes its part of a checkpoint directory through `write(path)` into a partial directory beside
    `final`, which then replaces `final` (a collective: call it on every rank).

    The save under that name before (`last`) stays whole until the new one is, so a save cut off midway never
    costs the only resumable checkpoint; and writers that refuse an existing directory (DeepSpeed copies NVMe-
    offloaded tensors with `copytree`) always get a fresh one.
    """
    final = Path(final)
    partial = partial_path(final)
    if strategy.local_rank == 0 and partial.exists():
        shutil.rmtree(partial)  # left behind by a save that was cut off
    strategy.barrier()
    write(partial)
    strategy.barrier()
    # Global rank 0 swaps on a shared file system; on node-local disks each node's local rank 0 swaps its own.
    if strategy.is_global_zero:
        _swap(partial, final)
    strategy.barrier()
    if strategy.local_rank == 0 and partial.exists():
        _swap(partial, final)
    strategy.barrier()


def _swap(partial: Path, final: Path) -> None:
    previous = final.with_name(f".{final.name}.previous")
    if final.exists():
        final.rename(previous)
    partial.rename(final)
    if previous.exists():
        shutil.rmtree(previous) if previous.is_dir() else previous.unlink()
