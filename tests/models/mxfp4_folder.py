"""A GPT-OSS `save_pretrained` folder as OpenAI publishes the model: its experts' weights in MXFP4 (`*_blocks`: two
4-bit values a byte, `*_scales`: a power of two for each 32 of them, along each output's inputs) and
`quantization_config.quant_method: mxfp4` in its config, the rest in bf16. Written from a bf16 folder by rounding
each expert weight to the nearest 4-bit value of its group's scale."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
PACKED = ("gate_up_proj", "down_proj")
# What OpenAI's config leaves in bf16 (openai/gpt-oss-20b's config.json).
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of `weight` (experts, inputs, outputs), as GPT-OSS's checkpoints hold it: each output's
    inputs in groups of 32, (experts, outputs, groups, 16) bytes and (experts, outputs, groups) exponents + 127."""
    rows = weight.float().transpose(1, 2)  # (experts, outputs, inputs)
    groups = rows.reshape(*rows.shape[:2], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0 ** -100) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    index = (scaled[..., None] - FP4).abs().argmin(-1).to(torch.uint8)  # -0.0 never wins a tie: +0.0 comes first
    blocks = index[..., 0::2] | (index[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def write_mxfp4_folder(source: Path, folder: Path) -> dict[str, torch.Tensor]:
    """`source` (a bf16 GPT-OSS folder of one or more shards) written to `folder` with its experts in MXFP4, one
    shard per source shard. Returns each packed weight's values as MXFP4 holds them (by the model's names)."""
    folder.mkdir(parents=True)
    index_file = source / "model.safetensors.index.json"
    files = sorted(set(json.loads(index_file.read_text())["weight_map"].values())) if index_file.is_file() else [
        "model.safetensors"]
    weight_map, values = {}, {}
    for file in files:
        tensors = load_file(source / file)
        for name in [name for name in tensors if name.endswith(PACKED)]:
            weight = tensors.pop(name)
            blocks, scales = quantized(weight)
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
            low, high = FP4[(blocks & 0x0F).long()], FP4[(blocks >> 4).long()]
            unpacked = torch.stack((low, high), -1).flatten(-2) * torch.exp2(scales.float() - 127)[..., None]
            values[name] = unpacked.flatten(-2).transpose(1, 2).to(weight.dtype)
        save_file(tensors, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    if index_file.is_file():
        (folder / index_file.name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"modules_to_not_convert": NOT_CONVERTED, "quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for other in source.iterdir():
        if not other.name.endswith((".safetensors", ".json")) or other.name == "generation_config.json":
            shutil.copy(other, folder / other.name)
    return values
