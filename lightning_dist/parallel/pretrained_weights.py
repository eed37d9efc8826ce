"""A `save_pretrained` folder's weights, read one tensor at a time, for a model built on the meta device.

A model built empty (sharded initialisation) carries the folder it should start from (`attach`); when a strategy
initialises the model's shards (sharded_init.py), each parameter's value is read from the folder instead of drawn,
in the parameter's dtype, and the rank keeps its shard of it. So a rank holds at most one full tensor besides its
shards, and the weights are never whole on any rank: a node's ranks together hold one copy of the model and about
two of its largest tensors each (BENCHMARKS.md). Reading only a rank's rows of each tensor would save the second.

safetensors maps each file and reads a tensor without copying it; the file is opened for each tensor and closed
once its value is copied out, so that the pages read do not stay mapped (counted in every rank's resident memory).
One file (`model.safetensors`) or several shards with their index (`model.safetensors.index.json`), as
transformers writes them; tied weights are saved once, under one of their names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# How many mismatches a refusal names.
_NAMED = 3


class PretrainedFolder:
    """The tensors of a `save_pretrained` folder: their names, shapes and files; values read one at a time."""

    def __init__(self, folder: str | Path, key: str = "pretrained") -> None:
        from safetensors import safe_open

        self.folder, self.key = Path(folder), key
        if (self.folder / INDEX).is_file():
            weight_map = json.loads((self.folder / INDEX).read_text())["weight_map"]
            self.files = {name: self.folder / file for name, file in weight_map.items()}
        elif (self.folder / SINGLE).is_file():
            with safe_open(self.folder / SINGLE, "pt") as single:
                self.files = {name: self.folder / SINGLE for name in single.keys()}
        else:
            raise FileNotFoundError(f"{key}={folder}: no {SINGLE} or {INDEX} there (a save_pretrained folder of"
                                    " safetensors files)")
        self.shapes: dict[str, tuple[int, ...]] = {}
        for file in sorted(set(self.files.values())):
            with safe_open(file, "pt") as opened:
                self.shapes.update({name: tuple(opened.get_slice(name).get_shape()) for name in opened.keys()})

    def read(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Tensor `name`, copied out of the file in `dtype` (on the CPU)."""
        from safetensors import safe_open

        with safe_open(self.files[name], "pt") as opened:
            stored = opened.get_tensor(name)
            return stored.to(dtype if stored.is_floating_point() else stored.dtype, copy=True)

    def attach(self, model: nn.Module) -> None:
        """Make `model` start from these weights (sharded initialisation reads them), after checking that they are
        the model's: ValueError naming the first mismatches. Persistent buffers are given their values now."""
        keys = self.keys_for(model)
        for name, buffer in model.named_buffers():
            if name in keys:
                buffer.copy_(self.read(keys[name], buffer.dtype))
        model.pretrained_weights = BoundWeights(self, keys)  # type: ignore[assignment]

    def keys_for(self, model: nn.Module) -> dict[str, str]:
        """The folder's name for each of `model`'s parameters and persistent buffers, by the model's names (each
        name of a tied parameter maps to the one it was saved under); ValueError naming the first mismatches."""
        prefix = f"{getattr(model, 'base_model_prefix', '')}."
        groups: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(param), []).append(name)
        tensors = model.state_dict(keep_vars=True)
        parameter_names = {name for names in groups.values() for name in names}
        persistent = [name for name in tensors if name not in parameter_names]
        keys: dict[str, str] = {}
        missing, shapes = [], []
        for names in [*groups.values(), *([name] for name in persistent)]:
            saved = next((found for name in names for found in (name, name.removeprefix(prefix))
                          if found in self.shapes), None)
            if saved is None:
                missing.append(names[0])
                continue
            expected = tuple(tensors[names[0]].shape)
            if self.shapes[saved] != expected:
                shapes.append(f"{saved} {self.shapes[saved]} in the folder, {expected} in the model")
            keys.update({name: saved for name in names})
        unexpected = sorted(set(self.shapes) - set(keys.values()))
        problems = [f"{label} {_first(found)}" for label, found in
                    (("missing", missing), ("unexpected", unexpected), ("shape", shapes)) if found]
        if problems:
            raise ValueError(f"{self.key}={self.folder}: its weights are not {type(model).__name__}'s: "
                             + "; ".join(problems))
        return keys


@dataclass
class BoundWeights:
    """A folder's weights by the names of the model they were attached to (`PretrainedFolder.attach`)."""

    folder: PretrainedFolder
    keys: dict[str, str]

    def read(self, name: str, dtype: torch.dtype) -> torch.Tensor | None:
        """The value of the model's parameter `name` in `dtype`, or None where the folder has none."""
        key = self.keys.get(name)
        return None if key is None else self.folder.read(key, dtype)


def _first(names: list[str]) -> str:
    more = f" (and {len(names) - _NAMED} more)" if len(names) > _NAMED else ""
    return ", ".join(names[:_NAMED]) + more
