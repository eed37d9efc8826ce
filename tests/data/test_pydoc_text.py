import torch

from lightning_dist.data.pydoc_text import NextTokenWindows, PydocTextDataModule, load_pydoc_bytes


def test_pydoc_text_is_the_bundled_english_help():
    tokens = load_pydoc_bytes()
    assert 400_000 < len(tokens) < 600_000
    assert tokens.dtype == torch.long and int(tokens.max()) < 256
    assert torch.equal(tokens, load_pydoc_bytes())


def test_windows_shift_targets_by_one():
    windows = NextTokenWindows(torch.arange(21), block_size=4)
    assert len(windows) == 5
    inputs, targets = windows[1]
    assert inputs.tolist() == [4, 5, 6, 7] and targets.tolist() == [5, 6, 7, 8]


def test_splits_are_disjoint_and_cover_the_text():
    data = PydocTextDataModule(block_size=64, val_fraction=0.05, test_fraction=0.05)
    data.setup()
    splits = [s.tokens for s in (data.train_set, data.val_set, data.test_set)]
    sizes = [len(tokens) for tokens in splits]
    # Consecutive slices that put back together give the text: no byte is in two splits, none is left out.
    assert torch.equal(torch.cat(splits), load_pydoc_bytes())
    assert abs(sizes[1] / sum(sizes) - 0.05) < 0.001
    assert next(iter(data.train_dataloader()))[0].shape == (16, 64)
