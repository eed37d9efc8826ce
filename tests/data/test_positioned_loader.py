"""Lightning warns that a resume from the middle of an epoch is unreliable unless the train loader is stateful:
the bundled data module's loader is (its position lives in the data module's state), a plain DataLoader is not,
so a user's own loader is still warned about."""

from torch.utils.data import DataLoader

from lightning_dist._compat.lightning import is_stateful_loader
from lightning_dist.data.sample_position import PositionedLoader


def test_the_bundled_loader_counts_as_resumable_and_a_plain_one_does_not():
    data = list(range(8))
    assert is_stateful_loader(PositionedLoader(data, batch_size=2))
    assert not is_stateful_loader(DataLoader(data, batch_size=2))
