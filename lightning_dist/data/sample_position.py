"""Where an epoch got to, in samples: a resumed run goes on with the next sample at any world size.

Lightning records a mid-epoch position as batches per rank and restarts the epoch's data from its first batch.
Counting samples instead, and shuffling the whole dataset by seed and epoch alone (as DistributedSampler does,
before it deals the order out to ranks), makes the position mean the same thing whatever the number of ranks.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler's shuffled order (identical when nothing is skipped), starting `skip` samples into the
    order of epoch `skip_epoch`; other epochs start at their beginning. Global step k of a run with W ranks and
    batch size B reads samples [k·B·W, (k+1)·B·W) of the epoch's order, so skipping k·B·W samples continues
    exactly there, at W or at any other number of ranks."""

    def __init__(
        self, dataset: Dataset, num_replicas: int, rank: int, seed: int, skip_epoch: int = 0, skip: int = 0
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.skip_epoch, self.skip = skip_epoch, skip

    def _samples(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]  # a sampled dataset is sized; torch types it unsized

    def _skipped(self) -> int:
        return self.skip if self.epoch == self.skip_epoch else 0

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(self._samples(), generator=generator)[self._skipped():].tolist()
        order += order[: -len(order) % self.num_replicas]  # every rank the same number of samples, as torch pads
        return iter(order[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return math.ceil((self._samples() - self._skipped()) / self.num_replicas)


class PositionedLoader(DataLoader):
    """A DataLoader whose position a data module saves and restores (its `state_dict`, read by a
    ResumableDistributedSampler). Stateful to Lightning, so that a resume from the middle of an epoch is not
    called unreliable: the loader itself has nothing to add, the data module's state says where it got to."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass
