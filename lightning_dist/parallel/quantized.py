"""Quantized base weights (bitsandbytes' 4-bit and 8-bit parameters: QLoRA's base), and who may train them.

A quantized weight is packed bytes whose quantization state (absmax, code, shape) lives beside them, in the
parameter and its layer. An engine that shards parameters (FSDP2, ZeRO-3, tensor and pipeline splitting) or casts the
model to its dtype (DeepSpeed's engine under a bf16 or fp16 config, a "-true" precision) rewrites those bytes as if
they were numbers, and the state no longer describes them.
Measured under FSDP2 (a 4-bit Llama, float32 storage, LoRA, 2 ranks, SGD): the first loss is one process's, the
second 4.8379 where one process has 4.8509, and no error; accelerate #3983 and bitsandbytes #1945 report the same,
down to a loss of 0 or NaN. DDP holds every rank's weights whole and moves them with bitsandbytes' own `.to`, and
trains them as one process does (measured with a 4-bit base: tests/models/test_finetune_runs.py), unless a "-true"
precision casts a float storage to another dtype (the packed shape then no longer matches: "shape '[64, 32]' is
invalid").
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_dist._compat.bitsandbytes import quantized_kind

# The dtype each "-true" precision converts the whole model to (Lightning's `convert_module`).
CONVERTED = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}


def quantized_weights(module: nn.Module) -> list[tuple[str, str, torch.dtype]]:
    """(name, "4-bit" or "8-bit", storage dtype) of each of `module`'s quantized parameters."""
    return [(name, kind, param.dtype) for name, param in module.named_parameters()
            if (kind := quantized_kind(param)) is not None]


def check_quantized_weights(module: nn.Module, strategy: str, keeps_them_whole: bool, precision: str | None) -> None:
    """Stop, in one line, where `strategy` would rewrite `module`'s quantized weights: it shards or casts them
    (`keeps_them_whole` False), or `precision` converts their float storage to another dtype."""
    found = quantized_weights(module)
    if not found:
        return
    name, kind, dtype = found[0]
    what = f"{name} is a bitsandbytes {kind} weight stored as {dtype}"
    if not keeps_them_whole:
        raise ValueError(
            f"{strategy}: {what}, which this strategy would shard or cast as numbers and train silently wrong"
            " (accelerate #3983); train a quantized base under ld_ddp, where every rank holds its weights whole,"
            " or load the base unquantized")
    target = CONVERTED.get(precision or "")
    if target is not None and dtype.is_floating_point and dtype != target:
        raise ValueError(
            f"precision={precision}: {what}, which converting the model to {target} would rewrite as numbers; use a"
            f" precision that keeps the model's dtypes (32-true, bf16-mixed) or a bnb_4bit_quant_storage of {target}")
