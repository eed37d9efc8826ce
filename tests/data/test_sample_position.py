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


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_resume_at_the_same_world_size_reads_the_uninterrupted_epochs_samples_to_its_padded_end(world_size):
    """The epoch's last batch repeats the samples the uninterrupted one repeats (torch pads with the epoch's first
    samples): padding after the skip repeated others, and a resumed run's last batch of the epoch differed (seen:
    a loss 1% off the uninterrupted run's at the last step of an epoch of 2,048-token windows)."""
    skip = 5 * 4 * world_size  # 5 steps of batches of 4
    assert global_order(world_size, skip=skip) == global_order(world_size)[skip:]


def test_a_resumed_epoch_is_as_long_as_lightning_counts_it():
    """Lightning ends an epoch when its restored count of batches reaches the loader's length: the loader of a
    resumed epoch is as long as the uninterrupted one's, of which it yields the batches left."""
    from lightning_dist.data.sample_position import PositionedLoader

    batch, world, done = 4, 2, 10
    whole = PositionedLoader(DATASET, batch_size=batch, sampler=ResumableDistributedSampler(DATASET, world, 0, 42))
    sampler = ResumableDistributedSampler(DATASET, world, 0, seed=42, skip_epoch=0, skip=done * batch * world)
    resumed = PositionedLoader(DATASET, batch_size=batch, sampler=sampler, batches_before=done)
    assert len(resumed) == len(whole) == 13  # 52 samples a rank (103 padded to 104), in batches of 4
    assert len(list(resumed)) == len(whole) - done
    sampler.set_epoch(1)  # the next epoch reads all of it again
    assert len(resumed) == len(list(resumed)) == 13


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_unshuffled_and_cut_orders_are_distributed_samplers_too(shuffle, drop_last, world_size):
    # A user's loader: Lightning's DistributedSampler follows the loader's `shuffle`; `drop_last` the user's own.
    for rank in range(world_size):
        torch_sampler = DistributedSampler(DATASET, world_size, rank, shuffle=shuffle, seed=5, drop_last=drop_last)
        ours = ResumableDistributedSampler(DATASET, world_size, rank, seed=5, shuffle=shuffle, drop_last=drop_last)
        skipped = ResumableDistributedSampler(DATASET, world_size, rank, seed=5, skip_epoch=2, skip=2 * world_size,
                                              shuffle=shuffle, drop_last=drop_last)
        for sampler in (torch_sampler, ours, skipped):
            sampler.set_epoch(2)
        assert list(ours) == list(torch_sampler) and len(ours) == len(torch_sampler)
        assert list(skipped) == list(torch_sampler)[2:] and len(skipped) == len(list(skipped))
