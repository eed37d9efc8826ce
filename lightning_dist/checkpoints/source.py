"""One checkpoint being loaded: where it is, its format, and whether its pickles may be read (vetted, or trusted
by the user). Built once, at the edge (run/compose.py), and passed down, so that the format is worked out, and the
checkpoint vetted, once however many steps the load takes (the checks before launch, consolidation, resume, the
DeepSpeed router). It is a path as well (`os.fspath`): it travels to the strategy as Lightning's `ckpt_path`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from lightning_dist.checkpoints.formats import checkpoint_format
from lightning_dist.checkpoints.safe_load import vet_checkpoint


@dataclass(frozen=True)
class CheckpointSource:
    path: Path
    format: str
    trusted: bool = False  # the user opted out of vetting (`weights_only=False`, `trust_checkpoint=true`)
    vetted: bool = False

    @classmethod
    def of(cls, path: str | Path | CheckpointSource, trusted: bool = False, key: str = "ckpt_path") -> CheckpointSource:
        """`path`'s source (a CheckpointError names `key` when it is no checkpoint); a source is returned as it is:
        its format is not worked out again."""
        if isinstance(path, CheckpointSource):
            return path
        return cls(Path(path), checkpoint_format(path, key), trusted)

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
