"""One checkpoint being loaded: where it is, its format, and whether its pickles may be read (vetted, or trusted
by the user). Built once, at the edge (run/compose.py), and passed down, so that the format is worked out, and the
checkpoint vetted, once however many steps the load takes (the checks before launch, consolidation, resume, the
DeepSpeed router). It is a path as well (`os.fspath`): it travels to the strategy as Lightning's `ckpt_path`."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from lightning_dist.checkpoints.formats import checkpoint_format
from lightning_dist.checkpoints.safe_load import vet_checkpoint

# The checkpoints this process saved (swap.py, background.py), on every rank. A Lightning checkpoint holds the module's
# hyperparameters, where lightning-hydra-template's modules keep a functools.partial (Hydra's `_partial_: true`
# optimizer): the safe unpickler refused it, and `trainer.test(ckpt_path="best")` failed on the checkpoint the same
# script had just saved. What this process wrote is no stranger's file: it is read as written.
_saved_here: set[str] = set()


def remember_saved(path: str | Path) -> None:
    _saved_here.add(os.path.realpath(path))


def saved_here(path: str | Path) -> bool:
    return os.path.realpath(path) in _saved_here


def weights_only_for(path: str | Path, weights_only: bool | None) -> bool | None:
    """Lightning's `weights_only` for loading `path`: False (read as written) where this process saved it and the
    user did not ask for either."""
    return False if weights_only is None and saved_here(path) else weights_only


@dataclass(frozen=True)
class CheckpointSource:
    path: Path
    format: str
    trusted: bool = False  # the user opted out of vetting (`weights_only=False`, `trust_checkpoint=true`)
    vetted: bool = False

    @classmethod
    def of(cls, path: str | Path | CheckpointSource, trusted: bool = False, key: str = "ckpt_path") -> CheckpointSource:
        """`path`'s source (a CheckpointError names `key` when it is no checkpoint); a source is returned as it is:
        its format is not worked out again. A checkpoint this process saved is trusted."""
        if isinstance(path, CheckpointSource):
            return path
        return cls(Path(path), checkpoint_format(path, key), trusted or saved_here(path))

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)

    @property
    def readable(self) -> bool:
        """Whether a reader that unpickles freely (DeepSpeed's, torch.distributed.checkpoint's) may open it."""
        return self.trusted or self.vetted

    def vet(self, key: str = "ckpt_path") -> CheckpointSource:
        """This source, its pickles checked to hold data only (UnsafeCheckpointError otherwise), unless trusted or
        checked already."""
        if self.readable:
            return self
        vet_checkpoint(self.path, key, self.format)
        return replace(self, vetted=True)
