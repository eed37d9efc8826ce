"""Weights a `save_pretrained` folder holds packed, read as the model's own tensors: GPT-OSS's experts as OpenAI
publishes them, in MXFP4 (`quantization_config.quant_method: mxfp4`; each weight `NAME` stored as `NAME_blocks`,
two 4-bit values a byte, and `NAME_scales`, a power of two for each 32 inputs of an output). A rank reads the blocks
and scales of its experts alone and unpacks them into the run's dtype (every MXFP4 value is exact in bf16), as
transformers' `from_pretrained(quantization_config=Mxfp4Config(dequantize=True))` does for the whole model; the model
then trains those weights unquantized. A folder quantized otherwise is named in one line (`quantization_refusal`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_dist._compat.transformers import mxfp4_unpacked

MXFP4 = "mxfp4"
BLOCKS, SCALES = "blocks", "scales"  # a packed weight NAME is stored as NAME_blocks and NAME_scales
# Inputs a scale covers, and how many a block's bytes hold (two a byte).
GROUP, GROUP_BYTES = 32, 16


def quant_method(config: dict[str, Any]) -> str | None:
    """How a folder's config.json says its weights are quantized (`quantization_config.quant_method`), or None."""
    quantization = config.get("quantization_config")
    return quantization.get("quant_method") if isinstance(quantization, dict) else None


def packed_tensors(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """{weight name: (its blocks' name, its scales' name, its shape unpacked: experts, inputs, outputs)} for every
    pair of MXFP4 tensors among `shapes` (the folder's names and shapes)."""
    packed: dict[str, tuple[str, str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        weight, _, part = name.rpartition("_")
        scales = f"{weight}_{SCALES}"
        if part == BLOCKS and scales in shapes and len(shape) == 4 and shape[-1] == GROUP_BYTES:
            experts, outputs, groups, _ = shape
            packed[weight] = (name, scales, (experts, groups * GROUP, outputs))
    return packed


def unpacked(read: Callable[[str, Any], torch.Tensor], blocks: str, scales: str, dtype: torch.dtype,
             region: tuple[slice, ...] | None) -> torch.Tensor:
    """The weight whose MXFP4 `blocks` and `scales` `read(name, experts)` gives (`experts`: a slice of the first
    dimension, or None for all), in `dtype`, or its `region` alone: only the experts the region keeps are read."""
    experts = region[0] if region else None
    weight = mxfp4_unpacked(read(blocks, experts), read(scales, experts), dtype)
    return weight if not region or len(region) == 1 else weight[(slice(None), *region[1:])]


def quantization_refusal(key: str, folder: Any, method: str) -> str:
    """One line for a folder quantized in a way these loaders do not unpack."""
    return (f"{key}={folder}: its weights are quantized ({method}: quantization_config.quant_method in its"
            f" config.json), which lightning_dist reads only unpacked from {MXFP4}; save them unquantized first"
            " (transformers' from_pretrained with the quantizer's dequantize option, then save_pretrained)")
