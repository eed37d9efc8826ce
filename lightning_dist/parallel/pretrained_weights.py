"""A `save_pretrained` folder's weights, read one tensor at a time, for a model built on the meta device.

A model built empty (sharded initialisation) carries the folder it should start from (`attach`); when a strategy
initialises the model's shards (sharded_init.py), each parameter's value is read from the folder instead of drawn,
in the parameter's dtype, and the rank keeps its shard of it. Where the strategy says which part of a tensor the
rank keeps (FSDP's and tensor parallelism's shards, the rows that hold a ZeRO-3 partition), only that region is read
from the file; where it keeps all of it, the tensor is read whole, one at a time. So the weights are never whole on
any rank: a node's ranks together hold one copy of the model, and each its part of the tensor being read
(BENCHMARKS.md, "Loading a pretrained model").

safetensors maps each file and reads a tensor without copying it; the file is opened for each tensor and closed
once its value is copied out, so that the pages read do not stay mapped (counted in every rank's resident memory).
One file (`model.safetensors`) or several shards with their index (`model.safetensors.index.json`), as
transformers writes them; tied weights are saved once, under one of their names. Names are mapped as transformers'
own `from_pretrained` maps them (its conversion mapping): a mixture of experts saved as the Hub has it, one tensor
per expert (Mixtral's `block_sparse_moe.experts.3.w1.weight`), loads into transformers' fused experts
(`mlp.experts.gate_up_proj`), the experts of a layer read and stacked when that tensor's shards are initialised.
Experts saved in MXFP4 (GPT-OSS as published) are unpacked as they are read (packed_weights.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_dist._compat.transformers import Sources, checkpoint_sources, conversion_mapping, converted
from lightning_dist.parallel.packed_weights import MXFP4, packed_tensors, quant_method, quantization_refusal, unpacked

# Where a rank's part of a tensor lies in it, a slice per dimension (the leading ones; the rest whole).
Region = tuple[slice, ...]

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
        config = self.folder / "config.json"
        self.quant_method = quant_method(json.loads(config.read_text())) if config.is_file() else None
        # Weights held packed (MXFP4) are presented by the model's names, in their unpacked shapes.
        self.packed = packed_tensors(self.shapes) if self.quant_method == MXFP4 else {}
        for weight, (blocks, scales, shape) in self.packed.items():
            del self.shapes[blocks], self.shapes[scales]
            self.shapes[weight] = shape

    def read(self, name: str, dtype: torch.dtype, region: Region | None = None) -> torch.Tensor:
        """Tensor `name`, or its `region` alone, copied out of the file in `dtype` (on the CPU)."""
        if name in self.packed:
            blocks, scales, _ = self.packed[name]
            return unpacked(lambda stored, experts: self.read(stored, dtype, experts and (experts,)), blocks,
                            scales, dtype, region)
        from safetensors import safe_open

        with safe_open(self.files[name], "pt") as opened:
            # A region is copied out of the file's pages that hold it alone; a whole tensor is those pages until
            # copied.
            stored = opened.get_tensor(name) if region is None else opened.get_slice(name)[region]
            return stored.to(dtype if stored.is_floating_point() else stored.dtype, copy=region is None)

    def attach(self, model: nn.Module) -> None:
        """Make `model` start from these weights (sharded initialisation reads them), after checking that they are
        the model's: ValueError naming the first mismatches. Persistent buffers are given their values now."""
        mapping = conversion_mapping(model)
        bound = BoundWeights(self, mapping, self.sources_for(model, mapping))
        for name, buffer in model.named_buffers():
            if name in bound.sources:
                buffer.copy_(bound.value(name, buffer.dtype))
        model.pretrained_weights = bound  # type: ignore[assignment]

    def sources_for(self, model: nn.Module, mapping: list[Any]) -> dict[str, Sources]:
        """Where each of `model`'s parameters and persistent buffers is in the folder, by the model's names, as
        transformers' `from_pretrained` finds them: under its name (or the base model's), renamed, or made from
        several (a mixture of experts saved one tensor per expert); each name of a tied parameter maps to the one it
        was saved under. ValueError naming the first mismatches."""
        found, unexpected = checkpoint_sources(model, mapping, self.shapes)
        groups: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(param), []).append(name)
        tensors = model.state_dict(keep_vars=True)
        parameter_names = {name for names in groups.values() for name in names}
        persistent = [name for name in tensors if name not in parameter_names]
        sources: dict[str, Sources] = {}
        missing, shapes = [], []
        for names in [*groups.values(), *([name] for name in persistent)]:
            saved = next((found[name] for name in names if name in found), None)
            if saved is None:
                missing.append(names[0])
                continue
            shape = self.shape_of(mapping, names[0], saved)
            expected = tuple(tensors[names[0]].shape)
            if shape != expected:
                shapes.append(f"{_named(saved)} {shape} in the folder, {expected} in the model")
            sources.update({name: saved for name in names})
        unexpected += sorted({key for saved in found.values() for _, key in saved}
                             - {key for saved in sources.values() for _, key in saved})
        problems = [f"{label} {_first(names)}" for label, names in
                    (("missing", missing), ("unexpected", unexpected), ("shape", shapes)) if names]
        if problems and self.quant_method not in (None, MXFP4):
            raise ValueError(quantization_refusal(self.key, self.folder, self.quant_method))
        if problems:
            raise ValueError(f"{self.key}={self.folder}: its weights are not {type(model).__name__}'s: "
                             + "; ".join(problems))
        return sources

    def shape_of(self, mapping: list[Any], name: str, sources: Sources) -> tuple[int, ...]:
        """The shape of what `sources` make (converted on the meta device: nothing read)."""
        if len(sources) == 1 and sources[0][0] is None:
            return self.shapes[sources[0][1]]
        return tuple(converted(mapping, name, sources, lambda key: torch.empty(self.shapes[key], device="meta")).shape)


class BoundWeights:
    """A folder's weights by the names of the model they were attached to (`PretrainedFolder.attach`)."""

    def __init__(self, folder: PretrainedFolder, mapping: list[Any], sources: dict[str, Sources]) -> None:
        self.folder, self.mapping, self.sources = folder, mapping, sources

    def read(self, name: str, dtype: torch.dtype, region: Region | None = None) -> torch.Tensor | None:
        """The value of the model's parameter `name` (or its `region`) in `dtype`, or None where the folder has
        none."""
        return self.value(name, dtype, region) if name in self.sources else None

    def value(self, name: str, dtype: torch.dtype, region: Region | None = None) -> torch.Tensor:
        """The value of the model's tensor `name`, which the folder has, in `dtype`: its `region` alone, read as such
        where the folder holds the tensor as it is (one made from several, or renamed by a conversion, is made whole
        first)."""
        sources = self.sources[name]
        if len(sources) == 1 and sources[0][0] is None:
            return self.folder.read(sources[0][1], dtype, region)
        whole = converted(self.mapping, name, sources, lambda key: self.folder.read(key, dtype))
        return whole if region is None else whole[region]

    def largest(self) -> int:
        """Elements of the largest tensor read: one made from several holds them all beside itself."""
        return max((sum(math.prod(self.folder.shapes[key]) for _, key in sources)
                    for sources in self.sources.values()), default=0)


def _named(sources: Sources) -> str:
    """How a refusal names a tensor's sources: the one, or the first and how many more."""
    return sources[0][1] + (f" (+{len(sources) - 1} more made into one)" if len(sources) > 1 else "")


def _first(names: list[str]) -> str:
    more = f" (and {len(names) - _NAMED} more)" if len(names) > _NAMED else ""
    return ", ".join(names[:_NAMED]) + more
