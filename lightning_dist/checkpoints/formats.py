"""What kind of checkpoint a path holds, and clear errors for paths that hold none."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

FILE = "file"                # torch.save'd dict: DDP, or anything consolidated
DEEPSPEED = "deepspeed"      # directory with a `latest` tag file and per-rank ZeRO shards
DISTRIBUTED = "distributed"  # torch.distributed.checkpoint directory (FSDP2): `.metadata` + shards + meta.pt
LIGHTNING_METADATA = "meta.pt"  # what Lightning's ModelParallelStrategy writes beside the shards: loops, callbacks
# Where Lightning's WeightAveraging moves the model's own weights in a checkpoint whose `state_dict` is the average.
CURRENT_MODEL_STATE = "current_model_state"
AVERAGING_STATE = "averaging_state"  # and the rest of its state (how many updates it averaged)
# Where a DeepSpeed checkpoint keeps that average: its engine saves the module (the model's own weights), and
# Lightning's DeepSpeed strategy leaves `state_dict` out of the engine's client state (strategies/deepspeed/average.py).
AVERAGE_STATE_DICT = "weight_average_state_dict"


class CheckpointError(ValueError):
    """A checkpoint path that does not hold what was expected; the message says what would."""


def command_exit(make: Callable[[], Path], done: str) -> int:
    """A checkpoint command's end (`python -m ...`): `done` and what `make` made, exit 0; or its one-line refusal on
    stderr, exit 2."""
    try:
        output = make()
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"{done}{output}")
    return 0


def unreadable(path: str | Path) -> str | None:
    """What of the checkpoint at `path` (a file, or a directory and everything in it) cannot be opened, said with the
    system's reason (permission, an I/O error, a file that vanished), or None. Each file is opened, not read: it
    costs as much as listing them. A checkpoint read half-way would fail there with a traceback, and one that cannot
    be opened is no checkpoint a run can start from."""
    path = Path(path)
    try:
        files = [path] if not path.is_dir() else [Path(top) / name for top, _, names in os.walk(path, onerror=_raise)
                                                  for name in names]
        for file in files:
            with open(file, "rb"):
                pass
    except OSError as error:
        return cannot_read(error)
    return None


def cannot_read(error: OSError) -> str:
    """An OSError in one phrase: `it cannot be read (Permission denied: /runs/x/last.ckpt)`."""
    return f"it cannot be read ({os_reason(error)})"


def os_reason(error: OSError) -> str:
    """The system's reason and the file it names: `Permission denied: /runs/x/last.ckpt`."""
    reason = error.strerror or str(error) or type(error).__name__
    return f"{reason}: {error.filename}" if error.filename else reason


def _raise(error: OSError) -> None:
    raise error


def is_deepspeed_dir(path: Path) -> bool:
    return path.is_dir() and (path / "latest").is_file()


def is_distributed_dir(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file()


# What `Trainer.fit(ckpt_path=...)` takes besides a path: Lightning's names for a checkpoint it finds itself.
LIGHTNING_CHECKPOINT_NAMES = ("last", "best", "hpc")


def check_fit_ckpt_path(ckpt_path: Any) -> None:
    """A `fit(ckpt_path=...)` that names a local path: CheckpointError unless a checkpoint is there. Lightning's own
    names, a model registry's and a URL are left for Lightning to find."""
    if not isinstance(ckpt_path, (str, os.PathLike)):
        return
    text = str(ckpt_path)
    if text in LIGHTNING_CHECKPOINT_NAMES or text.startswith("registry") or "://" in text:
        return
    checkpoint_format(text)


def checkpoint_format(path: str | Path, key: str = "ckpt_path") -> str:
    """FILE, DEEPSPEED or DISTRIBUTED; CheckpointError naming `key` when the path is none of them."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{key}: no checkpoint at {path} (expected a .ckpt file or checkpoint directory)")
    if path.is_file():
        for parent in path.parents:
            if is_deepspeed_dir(parent) or is_distributed_dir(parent):
                kind = "DeepSpeed" if is_deepspeed_dir(parent) else "distributed (FSDP)"
                raise CheckpointError(
                    f"{key}: {path} is one file inside the {kind} checkpoint directory {parent}; pass the directory"
                )
        return FILE
    if is_deepspeed_dir(path):
        return DEEPSPEED
    if is_distributed_dir(path):
        return DISTRIBUTED
    raise CheckpointError(
        f"{key}: {path} is a directory but not a checkpoint: expected a DeepSpeed checkpoint (with a 'latest' file)"
        " or a distributed FSDP checkpoint (with '.metadata')"
    )


def deepspeed_tag_dir(path: Path) -> Path:
    """The directory of the shards a DeepSpeed checkpoint's `latest` tag points at."""
    return path / (path / "latest").read_text().strip()


def is_complete(path: str | Path) -> bool:
    """Whether a checkpoint's save finished: the file a save writes last is present and readable."""
    import zipfile

    path = Path(path)
    if path.is_file():
        return zipfile.is_zipfile(path)  # torch.save writes a zip whose directory comes last
    if is_deepspeed_dir(path):  # DeepSpeed writes `latest` after every rank's shards
        return any(deepspeed_tag_dir(path).glob("*model_states.pt"))
    # torch.distributed.checkpoint commits `.metadata` after all shards; Lightning adds meta.pt after that.
    return is_distributed_dir(path) and (path / LIGHTNING_METADATA).is_file()


def _starts_as_a_zip(path: Path) -> bool:
    """Whether the file begins as a zip archive does. One cut off during its save still does; it ends without the
    zip's directory, so `is_complete` tells it apart."""
    with open(path, "rb") as file:
        return file.read(4) == b"PK\x03\x04"


def check_complete(path: str | Path, key: str = "ckpt_path", kind: str | None = None) -> None:
    """CheckpointError unless `path` is a checkpoint (of format `kind`, worked out when not given) whose save
    finished and was swapped into place."""
    path = Path(path)
    if kind is None:
        checkpoint_format(path, key)  # a CheckpointError for what is no checkpoint
    if path.is_file() and not _starts_as_a_zip(path):
        raise CheckpointError(
            f"{key}: {path} is not a checkpoint: torch.save writes a zip archive, and this file is not one; pass a "
            ".ckpt"
            " file or a checkpoint directory"
        )
    if path.name.endswith(".partial") or not is_complete(path):
        raise CheckpointError(
            f"{key}: {path} is not a complete checkpoint (a save cut off, or still being written); pass a complete"
            " one, or resume=true to continue from the newest complete one"
        )
