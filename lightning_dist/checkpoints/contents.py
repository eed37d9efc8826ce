"""What a checkpoint holds, read without loading its tensors: its model's keys, and whether they are this model's."""

from __future__ import annotations

from pathlib import Path

from lightning_dist.checkpoints.formats import DISTRIBUTED, FILE, CheckpointError, checkpoint_format, deepspeed_tag_dir
from lightning_dist.checkpoints.safe_load import load_file


def state_dict_keys(path: str | Path, trusted: bool = False) -> set[str]:
    """The model keys a checkpoint holds, read without loading its tensors."""
    path = Path(path)
    kind = checkpoint_format(path)
    if kind == FILE:
        return set(load_file(path, mmap=True, trusted=trusted)["state_dict"])
    if kind == DISTRIBUTED:
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        return {key.removeprefix("state_dict.") for key in metadata if key.startswith("state_dict.")}
    model_states = sorted(deepspeed_tag_dir(path).glob("*model_states.pt"))[0]
    return set(load_file(model_states, mmap=True, trusted=trusted)["module"])


def check_checkpoint_matches(path: str | Path, expected_keys: set[str], key: str = "ckpt_path", trusted: bool = False) -> None:
    """CheckpointError when the checkpoint is of another model (its keys differ from the model's)."""
    found = state_dict_keys(path, trusted)
    missing, unexpected = sorted(expected_keys - found), sorted(found - expected_keys)
    if missing or unexpected:
        raise CheckpointError(
            f"{key}: {path} holds another model's weights: {len(missing)} of this model's keys are missing"
            f" (e.g. {', '.join(missing[:3]) or '-'}) and {len(unexpected)} are not in this model"
            f" (e.g. {', '.join(unexpected[:3]) or '-'})"
        )
