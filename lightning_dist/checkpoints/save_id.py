"""Which save every shard of a checkpoint directory is from, recorded inside each shard file.

A directory's manifest (manifest.py) proves every file unchanged since its save. Without it (deleted, or the
directory copied by a tool that left it out), sizes and `.metadata` offsets were all that was checked, and a shard
file replaced by the same rank's shard of another save, same shape and size, was restored without a word. So each
rank's part of a sharded save carries the save's id (the step and a number drawn for that save) as an entry of its
own, `save_id.rank<R>`, inside the very file it writes, and Lightning's metadata file (`meta.pt`, global rank 0's)
records it too: a file from another save disagrees, and names its step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_dist.checkpoints.formats import CURRENT_MODEL_STATE

SAVE_ID = "save_id"


@dataclass(frozen=True)
class SaveId:
    step: int
    number: int  # drawn once per save by global rank 0, broadcast to every rank

    @classmethod
    def drawn(cls, step: int) -> SaveId:
        return cls(step, random.SystemRandom().getrandbits(62))

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.step, self.number], dtype=torch.int64, device="cpu")  # never a device context's

    @classmethod
    def of_tensor(cls, tensor: torch.Tensor) -> SaveId:
        step, number = (int(value) for value in tensor.tolist())
        return cls(step, number)


def sharded_layout(checkpoint: dict[str, Any], save_id: SaveId, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(what this rank's shards save, what global rank 0's metadata file holds): the shards as Lightning's
    ModelParallelStrategy lays them out (`state_dict`, `optimizer_<i>`), each rank's save id beside them; the rest
    of the checkpoint, and the save id, as its metadata."""
    state = {"state_dict": checkpoint.pop("state_dict")}
    if CURRENT_MODEL_STATE in checkpoint:  # the model's own weights, where `state_dict` is their average: shards too
        state[CURRENT_MODEL_STATE] = checkpoint.pop(CURRENT_MODEL_STATE)
    for index, optimizer in enumerate(checkpoint.pop("optimizer_states", [])):
        state[f"optimizer_{index}"] = optimizer
    state[SAVE_ID] = {f"rank{rank}": save_id.as_tensor()}
    checkpoint[SAVE_ID] = {"step": save_id.step, "number": save_id.number}
    return state, checkpoint


def mixed_save_problem(directory: Path, metadata: dict[str, Any]) -> str | None:
    """Which shard file of a torch.distributed.checkpoint directory is from another save than its metadata file
    (`metadata`, Lightning's `meta.pt`), naming both steps; None where all agree, or where the save recorded no id
    (an older save, or another tool's)."""
    from lightning_dist._compat.torch import read_entries

    recorded = metadata.get(SAVE_ID)
    if not isinstance(recorded, dict):
        return None
    expected = SaveId(recorded["step"], recorded["number"])
    for path, tensor in read_entries(str(directory), f"{SAVE_ID}.").items():
        found = SaveId.of_tensor(tensor)
        if found != expected:
            other = f"the save at step {found.step}" if found.step != expected.step else "another save at the same step"
            return (
                f"{directory / path} is of {other}; the rest of the checkpoint is of the save at step {expected.step}"
            )
    return None
