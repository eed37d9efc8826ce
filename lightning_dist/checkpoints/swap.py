"""Checkpoints (files and directories) written beside their final name and swapped in only when complete."""

from __future__ import annotations

import os
import shutil
import socket
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightning_dist._compat.lightning import StrategyMixin
from lightning_dist.checkpoints.manifest import write_manifest
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
    partial = clear_partial(strategy, final)
    try:
        write(partial)
    except BaseException as error:  # torch.distributed.checkpoint's CheckpointException is one
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        raise discard(partial, final, error) from error
    strategy.barrier()
    if strategy.is_global_zero:  # the storage is shared (`check_shared`): it sees every rank's part
        commit(partial, final)
    strategy.barrier()


def clear_partial(strategy: Ranks, final: Path) -> Path:
    """The partial path beside `final`, emptied of what a save that was cut off left there (a collective)."""
    partial = partial_path(final)
    check_shared(strategy, final.parent)
    if strategy.is_global_zero:
        # One rank owns the clean-up: on storage several nodes share, every node removing it at once fails on the
        # files another node removed first.
        _remove(partial, missing_ok=True)
    strategy.barrier()
    return partial


def discard(partial: Path, final: Path, error: BaseException) -> SaveFailed:
    """The failure of a save to `final`, said with the space left; its partial part removed (on a full disk, it
    would stay in the way of the next save)."""
    failed = SaveFailed(final, error)  # the space left is measured before the part written is removed
    _remove(partial, missing_ok=True)
    return failed


def commit(partial: Path, final: Path) -> None:
    """Once every rank's part is written: the record of a directory's shards, then the swap into place."""
    if partial.is_dir():
        write_manifest(partial)  # comes last (manifest.py)
    _swap(partial, final)


_seen_shared: set[Path] = set()


def check_shared(strategy: Ranks, directory: Path) -> None:
    """Before the first save into `directory`: every rank sees what global rank 0 writes there, or `NotShared` on
    every rank. A node that saves to a disk of its own keeps its ranks' shards where no other node can read them:
    every save then succeeds and none can be resumed."""
    if strategy.world_size == 1 or directory in _seen_shared:
        return
    probe = directory / f".{strategy.broadcast(uuid.uuid4().hex)}.shared.partial"  # .partial: never resumed from
    if strategy.is_global_zero:
        directory.mkdir(parents=True, exist_ok=True)
        probe.touch()
    strategy.barrier()
    sees = probe.is_file()
    every_rank_sees = strategy.reduce_boolean_decision(sees, all=True)
    if strategy.is_global_zero:
        probe.unlink(missing_ok=True)
    if not every_rank_sees:
        raise NotShared(directory, None if sees else strategy.global_rank)
    _seen_shared.add(directory)


class SwappedSaves(StrategyMixin):
    """Strategy mixin (before the Lightning strategy in the bases): every save is written beside its name and swapped
    in when complete. `last` is saved again and again under one name; a save cut off midway must not cost the
    previous one, and DeepSpeed's NVMe offload cannot save over an earlier save at all."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if type(self.checkpoint_io) is TorchCheckpointIO:  # Lightning's default
            self.checkpoint_io = PartialFileIO()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        save = super().save_checkpoint
        write_then_swap(self, self.broadcast(filepath), lambda path: save(checkpoint, path, storage_options))


class PartialFileIO(TorchCheckpointIO):
    """A file checkpoint written by torch.save straight to the partial path it is given. Lightning's own makes the
    whole checkpoint a buffer in memory, writes that to the system's temp directory and copies it over (fsspec's
    transaction, for atomicity): every save written twice, a full temp directory failing saves, a kill leaving a
    checkpoint-sized file there. The swap (above) makes the save atomic already."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options (got {storage_options!r})")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        # Our file, closed however the write ends: torch's own writer stays open in a failed save's traceback, and a
        # removed file's space comes back only once it is closed (on a full disk, nothing else could be written).
        with open(path, "wb") as file:
            torch.save(checkpoint, file)


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


def _remove(path: Path, missing_ok: bool = False) -> None:
    """Remove a checkpoint's file or directory; with `missing_ok`, also what another rank removes meanwhile."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=missing_ok)
    else:
        path.unlink(missing_ok=missing_ok)


class SaveFailed(RuntimeError):
    """A checkpoint save that failed, said with the space left where it was written: torch and DeepSpeed report a
    full disk as `unexpected pos 704 vs 598` or `iostream error`, never as no space."""

    def __init__(self, final: Path, error: BaseException) -> None:
        # The last line: torch.distributed.checkpoint puts each rank's traceback under its own first line.
        reason = (str(error).strip().splitlines() or [type(error).__name__])[-1].strip()
        super().__init__(f"saving the checkpoint {final} failed ({reason}); {space_left(final.parent)}")


class SaveFailedElsewhere(SaveFailed):
    """Another rank's save failed (said as that rank said it): this rank ends with it."""

    def __init__(self, said: str) -> None:
        RuntimeError.__init__(self, said)


class NotShared(SaveFailed):
    """Checkpoints written where not every node sees them (`check_shared`)."""

    def __init__(self, directory: Path, blind_rank: int | None) -> None:
        blind = "another node" if blind_rank is None else f"rank {blind_rank}, on {socket.gethostname()},"
        RuntimeError.__init__(
            self, f"checkpoints in {directory} are not on storage every node shares: {blind} does not see a file global"
            " rank 0 wrote there, so no node could resume from the shards each keeps; put hydra.run.dir on a file"
            " system all nodes share")


def space_left(directory: Path) -> str:
    try:
        usage = shutil.disk_usage(directory)
    except OSError:
        return f"{directory} cannot be read"
    full = "the disk is full: " if usage.free < max(usage.total // 100, 64 << 20) else ""
    return f"{full}{_size(usage.free)} free of {_size(usage.total)} on the file system of {directory}"


def _size(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"
