"""Checkpoints (files and directories) written beside their final name and swapped in only when complete."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_dist.checkpoints.ranks import Ranks


def partial_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.partial")


def write_then_swap(strategy: Ranks, final: str | Path, write: Callable[[Path], None]) -> None:
    """Every rank writes its part of a checkpoint (a file, or a directory of shards) through `write(path)` to a
    partial path beside `final`, which then replaces `final` (a collective: call it on every rank).

    The save under that name before (`last`) stays whole until the new one is, so a save cut off midway never
    costs the only resumable checkpoint; and writers that refuse an existing directory (DeepSpeed copies NVMe-
    offloaded tensors with `copytree`) always get a fresh one.
    """
    final = Path(final)
    partial = partial_path(final)
    if strategy.local_rank == 0 and partial.exists():
        _remove(partial)  # left behind by a save that was cut off
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


class SwappedSaves:
    """Strategy mixin (before the Lightning strategy in the bases): every save is written beside its name and swapped
    in when complete. `last` is saved again and again under one name; a save cut off midway must not cost the
    previous one, and DeepSpeed's NVMe offload cannot save over an earlier save at all."""

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None) -> None:
        save = super().save_checkpoint  # type: ignore[misc]
        write_then_swap(self, self.broadcast(filepath), lambda path: save(checkpoint, path, storage_options))  # type: ignore[attr-defined]


def _swap(partial: Path, final: Path) -> None:
    if partial.is_file() and not final.is_dir():
        os.replace(partial, final)  # atomic: `final` is the old file or the new one, never neither
        return
    # A directory cannot replace a non-empty one in one step: the old one steps aside first.
    previous = final.with_name(f".{final.name}.previous")
    if previous.exists():
        _remove(previous)
    if final.exists():
        final.rename(previous)
    partial.rename(final)
    if previous.exists():
        _remove(previous)


def _remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() else path.unlink()
