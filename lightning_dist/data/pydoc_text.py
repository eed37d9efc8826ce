"""Byte-level language-modelling data from text that ships with Python itself (`pydoc_data.topics`).

About 465 KB of English, present on every CPython install: the default run needs no network and no download.
"""

from __future__ import annotations

import os
import warnings

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from lightning_dist.data.sample_position import PositionedLoader, ResumableDistributedSampler
from lightning_dist.data.train_loader_place import epoch_in_progress
from lightning_dist.parallel.dims import parallel_dims_of


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


class PydocTextDataModule(L.LightningDataModule):
    """Train/val/test splits of the pydoc text: the first part trains, the tail is held out (val, then test).

    Mid-epoch checkpoints record how many samples of the epoch were done, so resuming continues with the next
    sample, at any world size (sample_position.py).
    """

    def __init__(self, block_size: int = 128, batch_size: int = 16, val_fraction: float = 0.05,
                 test_fraction: float = 0.05, num_workers: int = 0, repeat: int = 1) -> None:
        super().__init__()
        if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
            raise ValueError(f"data.repeat={repeat!r}: how many times the text is read end to end; give a whole"
                             " number, at least 1")
        if not 0 < val_fraction + test_fraction < 1:
            raise ValueError(
                f"data.val_fraction + data.test_fraction must be in (0, 1), got {val_fraction + test_fraction}"
            )
        self.save_hyperparameters()
        self.batch_size = batch_size
        # Where a checkpoint said the data got to: its epoch (the data's, sample_position.py), the samples of it
        # done, and how far Lightning's epoch number had run ahead of the data's.
        self._resume = {"epoch": 0, "samples_done": 0, "epoch_offset": 0}
        self._counted_from = (0, 0)  # (the data's epoch, batches processed) when this process's loader started
        self._sampler: ResumableDistributedSampler | None = None

    def setup(self, stage: str | None = None) -> None:
        # Repeated end to end: windows longer than the held-out tail of one copy (a long context's) can be cut.
        tokens = load_pydoc_bytes().repeat(self.hparams.get("repeat", 1))
        n_val = int(len(tokens) * self.hparams["val_fraction"])
        n_test = int(len(tokens) * self.hparams["test_fraction"])
        n_train = len(tokens) - n_val - n_test
        block = self.hparams["block_size"]
        self.train_set = NextTokenWindows(tokens[:n_train], block)
        self.val_set = NextTokenWindows(tokens[n_train : n_train + n_val], block)
        self.test_set = NextTokenWindows(tokens[n_train + n_val :], block)

    def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=shuffle, num_workers=self.hparams["num_workers"])

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        # One share of the data per data-parallel rank (the ranks of a tensor-parallel group read the same batches).
        shares = parallel_dims_of(trainer.strategy).sampler_kwargs(trainer.global_rank) if trainer is not None else {}
        if trainer is not None:  # called after Lightning restored its loops: their count is the checkpoint's in the
            # middle of an epoch (from an epoch's start, Lightning counts from 0)
            counted = _batches_processed(trainer) if self._resume["samples_done"] else 0
            self._counted_from = (self._resume["epoch"], counted)
        self._sampler = sampler = ResumableDistributedSampler(
            self.train_set,
            num_replicas=shares.get("num_replicas", 1),
            rank=shares.get("rank", 0),
            seed=int(os.environ.get("PL_GLOBAL_SEED", 0)),
            skip_epoch=self._resume["epoch"],
            skip=self._resume["samples_done"],
            epoch_offset=self._resume["epoch_offset"],
        )
        # As Lightning sets it when the epoch starts (in its numbering); the loader's length is asked before.
        sampler.set_epoch(self._resume["epoch"] + self._resume["epoch_offset"])
        return PositionedLoader(
            self.train_set, batch_size=self.batch_size, sampler=sampler, num_workers=self.hparams["num_workers"],
            batches_before=self._counted_from[1],
        )

    def state_dict(self) -> dict[str, int]:
        # `processed` counts the batches whose training step ran, whether the checkpoint is written at the end of
        # a batch or after a validation that followed it; batches run before a resume ran at another world size.
        # The epoch is the one the loader reads, with Lightning's number for it: the epoch in progress (Lightning's
        # `current_epoch` is one on after the run's last epoch, and after a stop in the middle of one).
        trainer = self.trainer
        assert trainer is not None, "a data module's state is saved by its trainer"
        offset = self._resume["epoch_offset"]
        epoch = self._sampler.epoch if self._sampler is not None else trainer.current_epoch - offset
        processed = _batches_processed(trainer)
        counted_epoch, counted_processed = self._counted_from
        if epoch == counted_epoch and epoch == self._resume["epoch"]:
            before = self._resume["samples_done"]
            processed -= counted_processed
        else:
            before = 0
        return {"epoch": epoch, "samples_done": before + processed * self.batch_size * _data_parallel_size(trainer),
                "lightning_epoch": epoch_in_progress(trainer)}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        if "samples_done" not in state_dict:  # written before positions were samples: batches, at the same world size
            state_dict = {"epoch": self.trainer.current_epoch if self.trainer is not None else 0,
                          "samples_done": state_dict.get("train_batches_done_in_epoch", 0) * self.batch_size
                          * _data_parallel_size(self.trainer)}
        epoch, samples_done = state_dict["epoch"], state_dict["samples_done"]
        lightning_epoch = state_dict.get("lightning_epoch")
        if lightning_epoch is None:  # written before: Lightning's `current_epoch`, which may be one on
            lightning_epoch = state_dict.get("trainer_epoch", epoch)
            reopened = getattr(self.trainer.strategy, "reopened_epoch", None) if self.trainer is not None else None
            if reopened is not None:  # a stop mid-epoch, whose epoch our strategies finish (train_loader_place.py)
                lightning_epoch = reopened
            elif lightning_epoch > epoch and samples_done >= len(self.train_set):  # saved after the run's last epoch
                lightning_epoch -= 1
        if samples_done >= len(self.train_set):  # that epoch was read whole: the resumed run reads the next
            epoch, samples_done, lightning_epoch = epoch + 1, 0, lightning_epoch + 1
        self._resume = {"epoch": epoch, "samples_done": samples_done, "epoch_offset": lightning_epoch - epoch}

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.evaluated_once(self.val_set), shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.evaluated_once(self.test_set), shuffle=False)

    def evaluated_once(self, dataset: Dataset) -> Dataset:
        """The held-out windows cut to a multiple of the data-parallel ranks: the `DistributedSampler` Lightning gives
        each then repeats none to even out their shares, every window is evaluated exactly once, and Lightning's
        warning that some might not be does not apply to these loaders. (The data-parallel ranks, not the world: the
        ranks of a tensor-, context- or pipeline-parallel group read the same windows, and a layout must evaluate
        the windows another layout of the same data-parallel size does.)"""
        ranks = _data_parallel_size(self.trainer)
        if ranks == 1:
            return dataset
        warnings.filterwarnings("ignore", message=_REPEATS_SAMPLES_WARNING)
        length = len(dataset)  # type: ignore[arg-type]
        return Subset(dataset, range(length - length % ranks))


_REPEATS_SAMPLES_WARNING = r"Using `DistributedSampler` with the dataloaders\. During `trainer\.test\(\)`"


def _data_parallel_size(trainer: L.Trainer | None) -> int:
    return parallel_dims_of(trainer.strategy).dp_size if trainer is not None else 1


def _batches_processed(trainer: L.Trainer) -> int:
    """The batches of this epoch whose training step ran (the training loop's progress tracker counts them)."""
    return trainer.fit_loop.epoch_loop.batch_progress.current.processed  # type: ignore[attr-defined]
