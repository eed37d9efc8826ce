"""Byte-level language-modelling data from text that ships with Python itself (`pydoc_data.topics`).

About 465 KB of English, present on every CPython install: the default run needs no network and no download.
"""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset


def load_pydoc_bytes() -> torch.Tensor:
    """The pydoc help topics, concatenated in sorted order so every process sees the same bytes."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[name] for name in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


class NextTokenWindows(Dataset):
    """Non-overlapping windows of `block_size + 1` tokens: inputs are the first `block_size`, targets the last."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        if len(tokens) <= block_size:
            raise ValueError(f"data: {len(tokens)} tokens cannot fill one window of block_size={block_size}")
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        window = self.tokens[start : start + self.block_size + 1]
        return window[:-1], window[1:]


class ResumableDataLoader(DataLoader):
    """A DataLoader whose next epoch can start `skip_batches` into the epoch's (seeded, so repeatable) order.

    Lightning restores the epoch and step of a mid-epoch checkpoint but restarts the epoch's batches from the
    first; this loader lets a resumed run see exactly the batches the uninterrupted run would have seen.
    """

    def __init__(self, *args, skip_batches: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.skip_batches = skip_batches

    def __iter__(self):
        iterator = super().__iter__()
        skip, self.skip_batches = self.skip_batches, 0  # only the resumed epoch starts part-way
        for _ in range(skip):
            next(iterator, None)
        return iterator


class PydocTextDataModule(L.LightningDataModule):
    """Train/val/test splits of the pydoc text: the first part trains, the tail is held out (val, then test).

    Mid-epoch checkpoints record how many training batches of the epoch were done, so resuming continues there.
    """

    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0 < val_fraction + test_fraction < 1:
            raise ValueError(f"data.val_fraction + data.test_fraction must be in (0, 1), got {val_fraction + test_fraction}")
        self.save_hyperparameters()
        self.batch_size = batch_size
        self._resume_at_batch = 0

    def setup(self, stage: str | None = None) -> None:
        tokens = load_pydoc_bytes()
        n_val = int(len(tokens) * self.hparams.val_fraction)
        n_test = int(len(tokens) * self.hparams.test_fraction)
        n_train = len(tokens) - n_val - n_test
        block = self.hparams.block_size
        self.train_set = NextTokenWindows(tokens[:n_train], block)
        self.val_set = NextTokenWindows(tokens[n_train : n_train + n_val], block)
        self.test_set = NextTokenWindows(tokens[n_train + n_val :], block)

    def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=shuffle, num_workers=self.hparams.num_workers)

    def train_dataloader(self) -> DataLoader:
        skip, self._resume_at_batch = self._resume_at_batch, 0
        return ResumableDataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.hparams.num_workers,
            skip_batches=skip,
        )

    def state_dict(self) -> dict[str, int]:
        # `processed` counts the batches whose training step ran, whether the checkpoint is written at the end of
        # a batch or after a validation that followed it.
        trainer = self.trainer
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed if trainer is not None else 0
        return {"train_batches_done_in_epoch": int(done)}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._resume_at_batch = state_dict.get("train_batches_done_in_epoch", 0)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)
