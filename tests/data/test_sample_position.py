"""The data position in samples: the next sample after a resume is the right one at any world size."""

from __future__ import annotations

import pytest
from torch.utils.data import DistributedSampler

from lightning_dist.data.sample_position import ResumableDistributedSampler

DATASET = list(range(103))  # not a multiple of any batch: the epoch's tail is padded


def global_order(world_size: int, skip: int = 0, epoch: int = 3) -> list[int]:
    """The ranks' samples dealt back together (rank r holds positions r, r + W, ...): with batches of B on every
    rank, step k reads positions [k·B·W, (k+1)·B·W) of this order."""
    per_rank = []
    for rank in range(world_size):
        sampler = ResumableDistributedSampler(DATASET, world_size, rank, seed=42, skip_epoch=epoch, skip=skip)
        sampler.set_epoch(epoch)
        per_rank.append(list(sampler))
        assert len(per_rank[-1]) == len(sampler)
    return [sample for dealt in zip(*per_rank) for sample in dealt]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_without_a_skip_the_order_is_distributed_samplers(world_size):
    for rank in range(world_size):
        ours = ResumableDistributedSampler(DATASET, world_size, rank, seed=42)
        torch_sampler = DistributedSampler(DATASET, world_size, rank, shuffle=True, seed=42)
        for epoch in (0, 1):
            ours.set_epoch(epoch)
            torch_sampler.set_epoch(epoch)
            assert list(ours) == list(torch_sampler)


@pytest.mark.parametrize("saved_at, resumed_at", [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_a_resume_at_another_world_size_reads_the_next_samples(saved_at, resumed_at):
    batch, steps_done = 4, 5
    before = global_order(saved_at)[: steps_done * batch * saved_at]
    after = global_order(resumed_at, skip=len(before))
    uninterrupted = global_order(1)  # the epoch's order itself
    assert before + after[: len(DATASET) - len(before)] == uninterrupted
    assert len(after) - (len(DATASET) - len(before)) < resumed_at  # only torch's padding to a multiple of the ranks


def test_the_skip_applies_to_its_own_epoch_only():
    sampler = ResumableDistributedSampler(DATASET, 1, 0, seed=42, skip_epoch=3, skip=40)
    sampler.set_epoch(3)
    assert len(list(sampler)) == 63
    sampler.set_epoch(4)
    assert len(list(sampler)) == 103
