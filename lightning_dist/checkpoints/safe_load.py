"""Checkpoints are read as data, never as code, unless the user opts in.

A checkpoint is a pickle, and unpickling can call any function the file names. `torch.load(weights_only=True)`
refuses everything but tensors, plain containers and an allow-list; we use it for every file we read, adding the
few DeepSpeed classes its optimizer states hold. The libraries underneath do not all do the same (DeepSpeed loads
its shards with `weights_only=False`; torch's distributed checkpoint unpickles `.metadata` and non-tensor items
freely), so `vet_checkpoint` reads every pickle of a checkpoint the safe way before they see it.
"""

from __future__ import annotations

import enum
import io
import pickle
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from lightning_dist._compat.deepspeed import zero_checkpoint_globals
from lightning_dist._compat.torch import DCP_METADATA_GLOBALS
from lightning_dist.checkpoints.formats import (
    DEEPSPEED,
    DISTRIBUTED,
    CheckpointError,
    checkpoint_format,
    deepspeed_tag_dir,
    is_deepspeed_dir,
)

OPT_IN = (
    "if you trust where it came from, opt in with trust_checkpoint=true (train.py) or trainer.fit(..., "
    "weights_only=False)"
)


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint that names code to run when loaded; refused unless the user trusts it."""


@contextmanager
def _allowed(path: Path, key: str, deepspeed: bool) -> Iterator[None]:
    try:
        with torch.serialization.safe_globals(zero_checkpoint_globals() if deepspeed else []):
            yield
    except pickle.UnpicklingError as error:
        named = re.search(r"GLOBAL ([\w.]+)", str(error))
        what = f"a reference to {named.group(1)}" if named else str(error).splitlines()[0]
        raise UnsafeCheckpointError(
            f"{key}: {path} holds {what}, code that loading it would run: refused; {OPT_IN}"
        ) from None


def load_file(path: str | Path, key: str = "ckpt_path", *, trusted: bool = False, **kwargs: Any) -> Any:
    """`torch.load` of one checkpoint file: tensors and plain data only, unless `trusted`."""
    path = Path(path)
    kwargs.setdefault("map_location", "cpu")
    if trusted:
        return torch.load(path, weights_only=False, **kwargs)
    with _allowed(path, key, deepspeed=_inside_deepspeed_dir(path)):
        return torch.load(path, weights_only=True, **kwargs)


def _inside_deepspeed_dir(path: Path) -> bool:
    return any(is_deepspeed_dir(parent) for parent in path.parents)


def vet_checkpoint(path: str | Path, key: str = "ckpt_path", kind: str | None = None) -> None:
    """UnsafeCheckpointError unless every pickle in the checkpoint at `path` (of format `kind`, worked out when not
    given) holds only data.

    Tensors are memory-mapped, not read: vetting costs about as much as listing the file's contents.
    """
    path = Path(path)
    kind = kind or checkpoint_format(path, key)
    if kind == DEEPSPEED:
        for file in sorted(deepspeed_tag_dir(path).glob("*.pt")):
            load_file(file, key, mmap=True)
    elif kind == DISTRIBUTED:
        _vet_distributed(path, key)
    else:
        load_file(path, key, mmap=True)


class _MetadataUnpickler(pickle.Unpickler):
    """torch.distributed.checkpoint's `.metadata` is a bare pickle of its own record classes: allow those only."""

    _MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    _NAMES = {("torch", "Size"), *DCP_METADATA_GLOBALS, ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
              ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if module in self._MODULES or (module, name) in self._NAMES or dtype:
            return super().find_class(module, name)
        if (module, name) in (("builtins", "getattr"), ("__builtin__", "getattr")):
            return _enum_member  # Python 3.11.0-3.11.4 pickle an enum member as getattr(its class, its name)
        raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")


def _enum_member(cls: Any, name: str) -> Any:
    """`getattr` as those Pythons' pickles of an enum member call it, and nothing else: the class is one the
    unpickler allowed, and only its members are read (a general getattr would reach any attribute of anything)."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError("Unsupported global: GLOBAL builtins.getattr")


def _vet_distributed(path: Path, key: str) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    with _allowed(path / ".metadata", key, deepspeed=False):
        metadata = _MetadataUnpickler(io.BytesIO((path / ".metadata").read_bytes())).load()
    # Non-tensor items (optimizer hyper-parameters, ...) are torch.save'd byte ranges inside the shard files.
    for index, item in metadata.state_dict_metadata.items():
        if not isinstance(item, BytesStorageMetadata):
            continue
        info = metadata.storage_data[MetadataIndex(index)]
        if getattr(info, "transform_descriptors", None):
            raise UnsafeCheckpointError(
                f"{key}: {path} stores {index} transformed (compressed); it cannot be vetted: {OPT_IN}"
            )
        with open(path / info.relative_path, "rb") as shard:
            shard.seek(info.offset)
            data = io.BytesIO(shard.read(info.length))
        with _allowed(path / info.relative_path, key, deepspeed=False):
            torch.load(data, map_location="cpu", weights_only=True)
    load_file(path / "meta.pt", key, mmap=True)
