"""Where an epoch got to, in samples: a resumed run goes on with the next sample at any world size.

Lightning records a mid-epoch position as batches per rank and restarts the epoch's data from its first batch.
Counting samples instead, and shuffling the whole dataset by seed and epoch alone (as DistributedSampler does,
before it deals the order out to ranks), makes the position mean the same thing whatever the number of ranks.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler's order (identical when nothing is skipped, shuffled or not), starting `skip` samples into
    the order of epoch `skip_epoch`; other epochs start at their beginning. Global step k of a run with W ranks and
    batch size B reads samples [k·B·W, (k+1)·B·W) of the epoch's order, so skipping k·B·W samples continues
    exactly there, at W or at any other number of ranks.

    Epochs here are the data's: Lightning's epoch `e` (`set_epoch`) reads the data's `e - epoch_offset`. They part
    in runs continued, under releases before our strategies finished a stopped epoch (train_loader_place.py), from a
    run stopped by `max_steps` in the middle of an epoch: Lightning had counted that epoch done and went on with the
    next epoch's number where the data went on with the rest of the unfinished epoch."""

    def __init__(
        self, dataset: Dataset, num_replicas: int, rank: int, seed: int, skip_epoch: int = 0, skip: int = 0,
        epoch_offset: int = 0, shuffle: bool = True, drop_last: bool = False,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.skip_epoch, self.skip, self.epoch_offset = skip_epoch, skip, epoch_offset

    def set_epoch(self, epoch: int) -> None:
        """Lightning's epoch number; the data's is `epoch - epoch_offset`."""
        super().set_epoch(epoch - self.epoch_offset)

    def _samples(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]  # a sampled dataset is sized; torch types it unsized

    def _skipped(self) -> int:
        return self.skip if self.epoch == self.skip_epoch else 0

    @property
    def resuming(self) -> bool:
        """Whether the epoch set is the one a resume starts within (samples skipped)."""
        return self._skipped() > 0

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self._samples(), generator=generator).tolist()
        else:
            order = list(range(self._samples()))
        # Every rank the same number of samples: the epoch's order padded with its own first samples, as torch pads
        # it (or cut, with drop_last), before the skip (a resumed epoch's last batch repeats what the uninterrupted
        # one's did); again after it, where the skip is not a whole number of rounds of these ranks (a resume at
        # another world size).
        order = self._evened(order)
        return iter(self._evened(order[self._skipped():])[self.rank :: self.num_replicas])

    def _evened(self, order: list[int]) -> list[int]:
        """`order` made a whole number of rounds of these ranks, as DistributedSampler makes it."""
        if self.drop_last:
            return order[: len(order) - len(order) % self.num_replicas]
        return order + order[: -len(order) % self.num_replicas]

    def __len__(self) -> int:
        if self.drop_last:
            return (self._samples() // self.num_replicas * self.num_replicas - self._skipped()) // self.num_replicas
        padded = self._samples() + -self._samples() % self.num_replicas
        return math.ceil((padded - self._skipped()) / self.num_replicas)


class PositionedLoader(DataLoader):
    """A DataLoader whose position a data module saves and restores (its `state_dict`, read by a
    ResumableDistributedSampler). Stateful to Lightning, so that a resume from the middle of an epoch is not
    called unreliable: the loader itself has nothing to add, the data module's state says where it got to.

    Its length is the epoch's as Lightning counts it: within a resumed epoch, the `batches_before` the resume that
    Lightning's restored progress counts as done, and the batches the sampler has left. Lightning ends an epoch
    when its count reaches the loader's length: with the batches left alone, a resumed epoch ended early by as
    many batches as ran before the resume, and its last samples were never read (seen at 2,048-token windows, an
    epoch of 26 batches resumed at 10 ended at 16)."""

    def __init__(self, *args: Any, batches_before: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches_before = batches_before

    def __len__(self) -> int:
        resuming = getattr(self.sampler, "resuming", False)
        return (self.batches_before if resuming else 0) + super().__len__()

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass
