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
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_dist._compat.lightning import StrategyMixin
from lightning_dist.checkpoints.formats import os_reason
from lightning_dist.checkpoints.manifest import write_manifest
from lightning_dist.checkpoints.ranks import Ranks
from lightning_dist.checkpoints.source import remember_saved
from lightning_dist.parallel.devices import gather_objects


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
    failure = None
    try:
        write(partial)
    except BaseException as error:  # torch.distributed.checkpoint's CheckpointException is one
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        failure = discard(partial, final, error)
    fail_together(failure)  # and a barrier: every rank's part is written
    if strategy.is_global_zero:  # the storage is shared (`check_shared`): it sees every rank's part
        try:
            commit(partial, final)
        except OSError as error:
            failure = discard(partial, final, error)
    fail_together(failure)
    remember_saved(final)


def fail_together(failure: SaveFailed | None) -> None:
    """A save that failed on any rank fails on every rank, each with the first failure's one line (a collective).
    Where one rank alone raised, the others would wait in the next collective until the job's timeout, and a rank
    that does not write (DDP's) has nothing of its own to say."""
    said = [line for line in gather_objects(None if failure is None else str(failure)) if line]
    if said:
        raise failure or SaveFailedElsewhere(said[0])


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
    """`partial` into `final`'s place. Where the save under that name cannot be moved aside (a directory or file this
    user may not change), the new save keeps a name of its own beside it: a save that cannot take its name is still a
    save, and never the end of the job."""
    if partial.is_file() and not final.is_dir():
        try:
            os.replace(partial, final)  # atomic: `final` is the old file or the new one, never neither
        except OSError as error:
            _keep_beside(partial, final, error)
        return
    # A directory cannot replace a non-empty one in one step: the old one steps aside first.
    previous = final.with_name(f".{final.name}.previous")
    _remove_stale(previous)
    if previous.exists():  # it stays (said): this save's own
        previous = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.previous")
    if final.exists() or final.is_symlink():
        try:
            final.rename(previous)
        except OSError as error:
            _keep_beside(partial, final, error)
            return
    partial.rename(final)
    _remove_stale(previous)


def _keep_beside(partial: Path, final: Path, error: OSError) -> None:
    """The new save, which cannot replace `final`, under `final`'s name with `.new` added (the newest whole
    checkpoint by time: `resume=true` finds it); the earlier one of that name, ours, makes way for it."""
    beside = final.with_name(f"{final.name}.new")
    _remove_stale(beside)
    if beside.exists():
        beside = final.with_name(f"{final.name}.{uuid.uuid4().hex[:8]}.new")
    partial.rename(beside)
    rank_zero_warn(f"the checkpoint {final} cannot be replaced ({os_reason(error)}): this save is {beside} instead")


def _remove_stale(path: Path) -> None:
    """Remove what an earlier save left (a checkpoint set aside); one that cannot be removed stays, said once."""
    if not (path.exists() or path.is_symlink()):
        return
    try:
        _remove(path)
    except OSError as error:
        rank_zero_warn(f"{path}, an earlier save set aside, cannot be removed ({os_reason(error)}); it stays")


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
