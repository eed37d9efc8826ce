"""A user's train loader picked up where a resumed run left its epoch: the interrupted epoch's order, from the batch
after the last one trained.

Lightning restores a run's place in its epoch but not its loader's. A plain `DataLoader` read the resumed epoch
again from its first batch (Lightning warns that the resume is unreliable: the run trained on those samples twice
and stepped more times that epoch than the uninterrupted run). And with worker processes, the first epoch of any
resumed run read epoch 0's order: Lightning makes the loader's iterator, whose workers take their first indices at
once, before it sets the sampler's epoch (Lightning #21938).

Under our strategies a train loader's `DistributedSampler` orders each epoch by seed and epoch alone, so the
restored place is enough to go on exactly: the sampler gets the restored epoch before Lightning makes its iterator,
and in the middle of an epoch it is replaced by one starting at the samples the interrupted run had read
(sample_position.py, as the bundled data does). Loaders that keep their own place (torchdata's
`StatefulDataLoader`) and samplers of the user's own are left as they are. At another world size or batch size the
rest of the epoch is dealt to this run's ranks; as Lightning counts a loader's batches once, when it prepares it,
the loader is then prepared again at the next epoch's start.

A run stopped in the middle of an epoch (`max_steps`, `max_time`, a callback's stop) saves that epoch as done:
Lightning runs the epoch-end hooks as it stops. Loaded for fit, such a checkpoint's loops are put back in the
middle of the epoch, so that the resumed run finishes it, whatever its loader; and one saved at an epoch's end, which
Lightning resumes under `max_steps` with a batch too many, between that epoch and the next.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.data import sized_len
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from lightning_dist._compat.lightning import (
    StrategyMixin,
    attached_trainer,
    close_ended_epoch,
    is_stateful_loader,
    loader_with_sampler,
    prepare_train_data_again,
    reopen_epoch_stopped_early,
    set_sampler_epoch,
)
from lightning_dist.data.sample_position import ResumableDistributedSampler

# Our checkpoints' record of the samples one batch of each train loader reads over the data-parallel ranks (None
# for a loader whose order is not known): with Lightning's count of the batches done, where the epoch's order got to.
SAMPLES_PER_BATCH = "train_samples_per_batch"
# And the samples the epoch read beyond what its counted batches read at that size: an epoch resumed at another world
# size or batch size read its first batches at the size saved before.
SAMPLES_OFFSET = "train_samples_offset"

# Lightning's warning at a mid-epoch resume of a loader it cannot resume: not so where every loader goes on exactly.
UNRESUMABLE_WARNING = r"You're resuming from a checkpoint that ended before the epoch ended"


class ContinuedSampler(ResumableDistributedSampler):
    """A `DistributedSampler`'s order in a run resumed `counted` samples per rank into epoch `skip_epoch` (with
    `skip` samples read by all ranks before): its length counts them too, as Lightning counts the batches before
    the resume among the epoch's, so that the epoch ends when its samples do."""

    def __init__(self, sampler: DistributedSampler, *, skip_epoch: int, skip: int, counted: int) -> None:
        super().__init__(sampler.dataset, sampler.num_replicas, sampler.rank, sampler.seed, skip_epoch=skip_epoch,
                         skip=skip, shuffle=sampler.shuffle, drop_last=sampler.drop_last)
        self.counted = counted

    def __len__(self) -> int:
        return super().__len__() + (self.counted if self.resuming else 0)


def order_by_epoch(dataloader: Any) -> DistributedSampler | None:
    """The loader's `DistributedSampler` where it alone orders the epoch (torch's own, under a plain batch sampler,
    in a loader that keeps no place of its own); None for any other loader."""
    if not isinstance(dataloader, DataLoader) or is_stateful_loader(dataloader):
        return None
    batch_sampler = dataloader.batch_sampler
    if type(batch_sampler) is not BatchSampler or type(batch_sampler.sampler) is not DistributedSampler:
        return None
    return batch_sampler.sampler


def in_mid_epoch(dataloader: Any, batches_done: int) -> bool:
    """Whether `batches_done` of the loader's epoch leave some to read (a loader without a length: any done)."""
    batches = sized_len(dataloader)
    return 0 < batches_done < (batches if batches is not None else batches_done + 1)


def continued(dataloader: Any, epoch: int, batches_done: int, saved_samples_per_batch: int | None,
              saved_offset: int = 0) -> Any:
    """`dataloader` as the resumed run reads it: epoch `epoch` after its first `batches_done` batches, each of
    `saved_samples_per_batch` samples over the interrupted run's ranks, and `saved_offset` samples more (at this
    run's ranks and batch size, the rest of the epoch's order dealt to them); the loader itself where there is
    nothing to skip, its order is not known, or the checkpoint does not say. Its length counts the batches done, as
    Lightning does.

    Raises CannotContinue where the loader's class cannot be made again with another sampler."""
    sampler = order_by_epoch(dataloader)
    if sampler is None or saved_samples_per_batch is None or not in_mid_epoch(dataloader, batches_done):
        return dataloader
    place = ContinuedSampler(sampler, skip_epoch=epoch, skip=batches_done * saved_samples_per_batch + saved_offset,
                             counted=batches_done * dataloader.batch_size)
    place.set_epoch(epoch)
    try:
        return loader_with_sampler(dataloader, place)
    except (MisconfigurationException, TypeError) as error:  # a DataLoader subclass Lightning cannot make again
        raise CannotContinue(f"{type(dataloader).__name__} cannot be made again with another sampler ({error})")


class CannotContinue(Exception):
    """Why a resumed epoch cannot go on where it stopped (`continued`)."""


def samples_per_batch(dataloader: Any) -> int | None:
    """The samples one batch of `dataloader` reads over the data-parallel ranks, where its order is known."""
    sampler = order_by_epoch(dataloader)
    return None if sampler is None else dataloader.batch_size * sampler.num_replicas


def epoch_in_progress(trainer: Any) -> int:
    """Lightning's number for the epoch in progress, or about to start: its `current_epoch` is one on after the run's
    last epoch, and after a stop in the middle of one (it counts that epoch done)."""
    return max(trainer.fit_loop.epoch_progress.current.started - 1, 0)


def place_in_epoch(trainer: Any) -> tuple[int, int]:
    """The epoch the fit loop is about to run, and the batches of it already done (as a checkpoint restored them)."""
    fit_loop = trainer.fit_loop
    done = fit_loop.epoch_loop.batch_progress.current.processed if fit_loop.restarting else 0
    return fit_loop.epoch_progress.current.processed, done


class ContinuesTrainLoaders(StrategyMixin):
    """Strategy mixin (before the Lightning strategy in the bases, and before the saves'): each train loader
    Lightning prepares for fit is set to the restored epoch, and goes on from the restored batch where its order is
    known. Each checkpoint records the samples a batch of each train loader reads (`SAMPLES_PER_BATCH`): what the
    batches Lightning counts as done read, at whatever world size and batch size they were saved."""

    _prepared_at: tuple[int, int] | None = None  # the place in the epoch the train loaders were last prepared for
    _loader_index = 0  # the train loader being prepared: Lightning prepares them in one order
    _samples_per_batch: tuple[int | None, ...] = ()  # this run's train loaders', in that order
    _saved_samples_per_batch: tuple[int | None, ...] = ()  # the loaded checkpoint's
    _offsets: tuple[tuple[int, int], ...] = ()  # this run's train loaders' (epoch, SAMPLES_OFFSET in that epoch)
    _saved_offsets: tuple[int, ...] = ()  # the loaded checkpoint's
    _restarting_loaders: int = 0  # train loaders of this fit that read their resumed epoch again from its start
    _quiet_unresumable: Any = None  # the warnings filter, while Lightning would call every loader unresumable
    _reload_setting: tuple[Any, int] | None = None  # the trainer and its own `reload_dataloaders_every_n_epochs`
    # The epoch the checkpoint loaded for fit was saved in as its run stopped mid-epoch, finished now (None for any
    # other checkpoint): the bundled data module counts Lightning's epochs from it (data/pydoc_text.py).
    reopened_epoch: int | None = None

    def process_dataloader(self, dataloader: Any) -> Any:
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]  # connected: Lightning prepares its data
        if not trainer.training:  # a validation, test or predict loader, or the sanity check's
            return dataloader
        index, self._loader_index = self._loader_index, self._loader_index + 1
        self._samples_per_batch = (*self._samples_per_batch[:index], samples_per_batch(dataloader))
        saved = self._saved_samples_per_batch[index] if index < len(self._saved_samples_per_batch) else None
        saved_offset = self._saved_offsets[index] if index < len(self._saved_offsets) else 0
        epoch, done = self._prepared_at = place_in_epoch(trainer)
        self._offsets = (*self._offsets[:index], (epoch, 0))
        try:
            resumed = continued(dataloader, epoch, done, saved, saved_offset)
        except CannotContinue as why:
            rank_zero_info(f"Resumed in epoch {epoch} after {done} batches: the train loader reads the epoch again"
                           f" from its first batch, as Lightning does: {why}")
            resumed = dataloader
        if resumed is not dataloader:
            assert saved is not None  # continued only where the checkpoint says what a batch read
            read = done * saved + saved_offset
            rank_zero_info(f"Resumed in epoch {epoch} after {done} batches ({read} samples): the train loader goes on"
                           " with the next sample, in the interrupted run's order")
            self._offsets = (*self._offsets[:index], (epoch, read - done * (samples_per_batch(dataloader) or 0)))
            if len(resumed) != len(dataloader):
                self._ask_again_next_epoch(trainer, saved, samples_per_batch(dataloader), len(resumed))
        elif in_mid_epoch(dataloader, done) and not is_stateful_loader(dataloader):
            self._restarting_loaders += 1
        elif self._reload_setting is not None and not trainer.fit_loop.restarting:
            self._end_reload()  # asked for again at the epoch after the resumed one: as the user set it from here
        # Before Lightning makes the iterator, whose workers take their first indices at once (Lightning #21938).
        set_sampler_epoch(resumed, epoch)
        return resumed

    def _ask_again_next_epoch(self, trainer: Any, saved: int, now: int | None, batches: int) -> None:
        """At another world size or batch size the resumed epoch has another number of batches than the next ones,
        and Lightning counts a loader's batches once, when it is prepared: it is asked for again (prepared anew)
        as the next epoch starts, by Lightning's own `reload_dataloaders_every_n_epochs`, for that epoch only."""
        if self._reload_setting is None:
            self._reload_setting = (trainer, trainer.reload_dataloaders_every_n_epochs)
        trainer.reload_dataloaders_every_n_epochs = 1
        rank_zero_info(f"The resumed epoch has {batches} batches at this world size or batch size ({saved} samples a"
                       f" batch over the ranks when saved, {now} now): the train loader is asked for again at the"
                       " next epoch's start")

    def _end_reload(self) -> None:
        if self._reload_setting is not None:
            trainer, setting = self._reload_setting
            trainer.reload_dataloaders_every_n_epochs = setting
            self._reload_setting = None

    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]  # in training
        if self._prepared_at != place_in_epoch(trainer):
            # Prepared before the checkpoint restored the loops: asked for while the strategy set up (the steps a
            # learning-rate schedule spans, `trainer.estimated_stepping_batches`), and not again by Lightning, which
            # then also never gave a stateful loader its saved state (Lightning #20550).
            self._loader_index = self._restarting_loaders = 0
            prepare_train_data_again(trainer)
        if trainer.fit_loop.restarting and not self._restarting_loaders:
            self._quiet_unresumable = warnings.catch_warnings()
            self._quiet_unresumable.__enter__()
            warnings.filterwarnings("ignore", message=UNRESUMABLE_WARNING)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._end_quiet()  # Lightning warned (or not) as the epoch loop reset, before its first batch
        self._loader_index = 0  # the next loaders prepared (a reload, `reload_dataloaders_every_n_epochs`) start over
        super().on_train_batch_start(batch, batch_idx)

    def with_samples_per_batch(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """`checkpoint` with the record of this run's train loaders (for a save that does not pass through here)."""
        if not self._samples_per_batch:
            return checkpoint
        epoch = epoch_in_progress(self.lightning_module.trainer)  # type: ignore[union-attr]  # saving its state
        offsets = [offset if at == epoch else 0 for at, offset in self._offsets]
        return {**checkpoint, SAMPLES_PER_BATCH: list(self._samples_per_batch), SAMPLES_OFFSET: offsets}

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        super().save_checkpoint(self.with_samples_per_batch(checkpoint), filepath, storage_options)

    def read_loader_record(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """Each engine's `load_checkpoint` hands its checkpoint, in whatever format it was, through here: its record
        of what the train loaders read (none in one Lightning's own strategies saved: those restart the epoch), and
        its place in the epoch, which a run that stopped mid-epoch saved as the epoch's end (and one saved at an
        epoch's end, as Lightning resumes it under `max_epochs` only)."""
        self._saved_samples_per_batch = tuple(checkpoint.get(SAMPLES_PER_BATCH) or ())
        self._saved_offsets = tuple(checkpoint.get(SAMPLES_OFFSET) or ())
        trainer = attached_trainer(self.lightning_module)
        self.reopened_epoch = None
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if fitting and (stopped := reopen_epoch_stopped_early(checkpoint)):
            self.reopened_epoch, done = stopped
            rank_zero_info(f"The checkpoint was saved as its run stopped in epoch {self.reopened_epoch} after {done}"
                           " batches (max_steps, max_time or a callback's stop): the resumed run finishes that epoch,"
                           " which Lightning had counted done")
        elif fitting:
            close_ended_epoch(checkpoint)  # saved at an epoch's end: the next epoch from its first batch, as Lightning
            # does under `max_epochs` but not under `max_steps`
        return checkpoint

    def teardown(self) -> None:
        self._end_quiet()
        self._end_reload()
        self._prepared_at, self._loader_index, self._restarting_loaders = None, 0, 0
        self.reopened_epoch = None
        self._samples_per_batch = self._saved_samples_per_batch = ()
        self._offsets, self._saved_offsets = (), ()
        super().teardown()

    def _end_quiet(self) -> None:
        if self._quiet_unresumable is not None:
            self._quiet_unresumable.__exit__(None, None, None)
            self._quiet_unresumable = None
