"""Which of a user's train loaders a resumed run picks up in the middle of an epoch (data/train_loader_place.py), in
one process: a plain DataLoader over Lightning's DistributedSampler goes on with the rest of the epoch's order; a
loader that keeps its own place, or whose order is the user's own, is left alone; at another batch size the rest of
the order is dealt in the new batches; a loader class that cannot be made again says why it reads the epoch again."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_dist.data.train_loader_place import CannotContinue, continued, order_by_epoch, samples_per_batch

DATA = TensorDataset(torch.arange(66))


def sampled(rank: int = 0, replicas: int = 2, shuffle: bool = True) -> DistributedSampler:
    return DistributedSampler(DATA, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=0)


def numbers(loader) -> list[list[int]]:
    return [batch.tolist() for (batch,) in loader]


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("shuffle", [True, False])
def test_a_plain_loader_goes_on_with_the_rest_of_the_epoch_s_order(rank, shuffle):
    loader = DataLoader(DATA, batch_size=4, sampler=sampled(rank, shuffle=shuffle))
    loader.sampler.set_epoch(1)
    uninterrupted = numbers(loader)
    resumed = continued(loader, epoch=1, batches_done=3, saved_samples_per_batch=samples_per_batch(loader))
    resumed.sampler.set_epoch(1)
    assert numbers(resumed) == uninterrupted[3:]
    assert len(resumed) == len(loader) == 9  # Lightning counts the 3 batches done among the epoch's
    resumed.sampler.set_epoch(2)  # the next epoch: all of it
    loader.sampler.set_epoch(2)
    assert numbers(resumed) == numbers(loader)


def test_nothing_to_skip_or_no_record_leaves_the_loader_as_it_is():
    loader = DataLoader(DATA, batch_size=4, sampler=sampled())
    assert continued(loader, 1, 0, 8) is loader  # the epoch's start
    assert continued(loader, 1, 9, 8) is loader  # the epoch's end
    assert continued(loader, 1, 3, None) is loader  # a checkpoint of Lightning's own strategies


def test_loaders_whose_order_is_not_known_are_left_alone():
    class OwnSampler(DistributedSampler):
        pass

    assert order_by_epoch(DataLoader(DATA, batch_size=4, sampler=sampled())) is not None
    assert order_by_epoch(DataLoader(DATA, batch_size=4, sampler=RandomSampler(DATA))) is None
    assert order_by_epoch(DataLoader(DATA, batch_size=4, sampler=OwnSampler(DATA, 2, 0))) is None
    assert order_by_epoch(DataLoader(DATA, batch_sampler=BatchSampler(sampled(), 4, False))) is not None
    assert order_by_epoch(StatefulDataLoader(DATA, batch_size=4, sampler=sampled())) is None  # keeps its own place
    loader = StatefulDataLoader(DATA, batch_size=4, sampler=sampled())
    assert continued(loader, 1, 3, 8) is loader


def test_at_another_batch_size_the_rest_of_the_epoch_is_dealt_in_the_new_batches():
    # Saved at 8 samples a batch over the ranks (2 ranks of 4), resumed at 2 ranks of 2: the 24 samples of the
    # first 3 batches are skipped, the rest of the order dealt as DistributedSampler deals it.
    both = [sampled(rank) for rank in (0, 1)]
    for sampler in both:
        sampler.set_epoch(1)
    order = [number for pair in zip(*(list(sampler) for sampler in both)) for number in pair]
    for rank in (0, 1):
        loader = DataLoader(DATA, batch_size=2, sampler=sampled(rank))
        resumed = continued(loader, epoch=1, batches_done=3, saved_samples_per_batch=8)
        resumed.sampler.set_epoch(1)
        assert [n for batch in numbers(resumed) for n in batch] == order[24:][rank::2]
        assert len(resumed) == 3 + 11  # Lightning's 3 done, then 21 samples in batches of 2


def test_a_loader_class_that_cannot_be_made_again_says_so():
    class Windows(DataLoader):  # a required argument it does not keep
        def __init__(self, tokens, window):
            super().__init__(DATA, batch_size=window, sampler=sampled())

    loader = Windows(None, 4)
    with pytest.raises(CannotContinue, match="Windows cannot be made again with another sampler"):
        continued(loader, 1, 3, samples_per_batch(loader))
