"""Checkpoints written in the background (`checkpoint.async=true`): the training step waits only while the state is
copied out of the model (staged); a writer thread writes the copy beside its final name and swaps it into place
when it is whole, as a synchronous save does (swap.py), so a save cut off midway never costs the previous one.

One writer thread per process writes the saves in the order they were staged. Saves of a sharded checkpoint are
collective (torch.distributed.checkpoint gathers every rank's write plan and results), so every rank must run them
in the same order, on a process group of their own: the training's collectives go on meanwhile on the default group.
A save under a name whose previous save is still being written waits for it (its partial path is the new one's).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_dist._compat.lightning import StrategyMixin
from lightning_dist.checkpoints.formats import LIGHTNING_METADATA
from lightning_dist.checkpoints.save_id import SaveId, sharded_layout
from lightning_dist.checkpoints.source import remember_saved
from lightning_dist.checkpoints.swap import SaveFailed, SaveFailedElsewhere, clear_partial, commit, discard
from lightning_dist.parallel.devices import gather_objects


class BackgroundWriter:
    """This process's writer thread, and the saves it has not finished, by final path."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._pending: dict[Path, Future] = {}
        self._failed = False  # a write failed: nothing is removed from then on

    def submit(self, final: Path, write: Callable[[], None]) -> None:
        def run() -> None:
            try:
                write()
            except BaseException:
                self._failed = True
                raise

        self._pending[final] = self._thread.submit(run)

    def submit_after_writes(self, action: Callable[[], None]) -> None:
        """Run `action` (a superseded checkpoint's removal) once every save submitted before it is written, and only
        if they all were: the save that was to replace it may be the one that failed."""
        self._thread.submit(lambda: None if self._failed else action())

    def wait(self, final: Path | None = None) -> BaseException | None:
        """Wait for the save to `final` (None: for every save); the first error one raised, else None."""
        futures = [self._pending.pop(final)] if final in self._pending else []
        if final is None:
            futures, self._pending = list(self._pending.values()), {}
            futures.append(self._thread.submit(lambda: None))  # and the removals queued behind them
        errors = [error for future in futures if (error := future.exception()) is not None]
        return errors[0] if errors else None

    def close(self) -> BaseException | None:
        error = self.wait()
        self._thread.shutdown(wait=True)
        return error


def stage(state: Any) -> Any:
    """A copy of `state` (nested dicts and lists of tensors, DTensors, plain data) in host memory, pinned where
    there is CUDA, so that training can change the weights while the copy is written."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    pinned = torch.cuda.is_available()
    stager = DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=False,
                                          use_non_blocking_copy=False))
    try:
        return stager.stage(state)
    finally:
        stager.close()


class BackgroundSaves(StrategyMixin):
    """Strategy mixin (before SwappedSaves in the bases): with `self.async_checkpoint`, every save is staged in the
    step and written by the writer thread; the strategy says how its checkpoint is staged and written
    (`staged_write`). Without it, saves are SwappedSaves' synchronous ones."""

    async_checkpoint: bool = False
    _writer: BackgroundWriter | None = None
    _writer_group: Any = None

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any = None) -> None:
        if not self.async_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        final = Path(self.broadcast(filepath))
        writer = self._background_writer()
        self._raise_if_any_failed(writer.wait(final), final)  # and its partial path is free again
        partial = clear_partial(self, final)
        write = self.staged_write(checkpoint, partial)
        commits = self.is_global_zero

        def write_then_swap() -> None:
            try:
                write()
                if commits:  # the storage is shared: rank 0 sees every rank's part, complete once `write` returns
                    commit(partial, final)
            except BaseException as error:  # one line on every rank (the raw CheckpointException is each rank's
                # traceback); rank 0 removes the part written
                raise (discard(partial, final, error) if commits else SaveFailed(final, error)) from error

        writer.submit(final, write_then_swap)
        remember_saved(final)

    def staged_write(self, checkpoint: dict[str, Any], partial: Path) -> Callable[[], None]:
        """Stage `checkpoint` now; return what writes the staged copy to `partial` (run by the writer thread).
        Here: one file, written by global rank 0 (DDP, and FSDP gathering a full state dict)."""
        if not self.is_global_zero:
            return lambda: None
        staged, io = stage(checkpoint), self.checkpoint_io
        return lambda: io.save_checkpoint(staged, partial)

    def sharded_write(self, checkpoint: dict[str, Any], partial: Path, staged: bool = True) -> Callable[[], None]:
        """A sharded checkpoint in Lightning's ModelParallelStrategy layout, each rank's shards carrying the save's
        id (save_id.py); the returned write is torch.distributed.checkpoint's collective save. `staged`: every rank
        copies its shards now and the write runs on the writer's process group (the writer thread); else it writes
        the live state, on the training's group, when called. Lightning's metadata (loops, callbacks) is small and
        written now, by global rank 0. A collective: every rank calls it."""
        from torch.distributed.checkpoint import DefaultSavePlanner, save

        save_id = self.broadcast(SaveId.drawn(int(checkpoint.get("global_step", 0))))
        state, metadata = sharded_layout(checkpoint, save_id, self.global_rank)
        if staged:
            state = stage(state)
        partial.mkdir(parents=True, exist_ok=True)
        if self.is_global_zero:
            torch.save(metadata, partial / LIGHTNING_METADATA)
        group = self._writer_group if staged else None
        # One rank writes as one process does. DCP's plan exchange, a gloo gather, copies in parallel on gloo's worker
        # thread once the plan outgrows ATen's grain size (32,768 bytes); its OpenMP team, beside the training's, puts
        # libgomp over the cores, which then throttles its spin-wait: every later parallel op of a 1-rank CPU run
        # waited on a sleeping worker (15% slower steps after the first save on the default GPT, 60% on deeper ones).
        # Replicated items (buffers each rank keeps for itself, BatchNorm's statistics) are written as rank 0 holds
        # them, as DDP and DeepSpeed save them: DCP's default takes each from the rank that wrote least so far, a
        # checkpoint mixing the ranks' statistics. Shards held by several ranks (HSDP's replicas) are equal anyway.
        planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
        return lambda: save(state, checkpoint_id=partial, process_group=group, no_dist=self.world_size == 1,
                            planner=planner)

    def remove_checkpoint(self, filepath: str | Path) -> None:
        """A superseded checkpoint (ModelCheckpoint's top-k) is removed only once the saves before it are written:
        a kill meanwhile leaves the old one, not neither."""
        if not self.async_checkpoint or self._writer is None:
            return super().remove_checkpoint(filepath)
        remove = super().remove_checkpoint
        self._writer.submit_after_writes(lambda: remove(filepath))

    def wait_for_checkpoints(self) -> None:
        """Block until every save this process started is written and in place (the end of fit, a preemption)."""
        if self._writer is not None:
            error, self._writer = self._writer.close(), None
            if error is not None:
                raise error

    def finish_checkpoints(self) -> None:
        """Fit's end, on every rank together (a collective): the saves are waited for, and a failed one fails every
        rank with its line (under DDP only rank 0 writes: alone, it would leave the others to be killed by
        Lightning's launcher). The run's summary calls it before it says the run finished."""
        error = None
        if self._writer is not None:
            error, self._writer = self._writer.close(), None
        if self.async_checkpoint:
            said = [failure for failure in gather_objects(None if error is None else str(error)) if failure]
            if said:
                raise error or SaveFailedElsewhere(said[0])

    def on_train_end(self) -> None:
        self.finish_checkpoints()
        super().on_train_end()

    def teardown(self) -> None:
        self.wait_for_checkpoints()
        super().teardown()

    def _background_writer(self) -> BackgroundWriter:
        if self._writer is None:
            if dist.is_initialized() and self._writer_group is None:
                # Host tensors, and collectives beside the training's: gloo, a group of its own (every rank here).
                self._writer_group = dist.new_group(backend="gloo")
            self._writer = BackgroundWriter()
        return self._writer

    def _raise_if_any_failed(self, error: BaseException | None, final: Path) -> None:
        """A background write that failed is raised at the next save under its name, on every rank together."""
        if self.reduce_boolean_decision(error is not None, all=False):
            raise error or SaveFailed(final, RuntimeError("another rank's background write of it failed"))
