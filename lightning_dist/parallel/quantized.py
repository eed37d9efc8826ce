"""Quantized base weights (bitsandbytes' 4-bit and 8-bit parameters: QLoRA's base), and how each strategy may hold
them.

A quantized weight is packed bytes whose quantization state (absmax, code, shape) lives beside them, in the
parameter and its layer. Three things rewrite those bytes as if they were numbers, after which the state no longer
describes them and training goes silently wrong (accelerate #3983, bitsandbytes #1945: down to a loss of 0 or NaN):
- a cast to another dtype: DeepSpeed's engine holds every parameter in its config's dtype, FSDP2 gathers in its
  mixed-precision dtype, a "-true" precision converts the whole model ("shape '[64, 32]' is invalid");
- splitting a weight along its rows or columns (tensor parallelism), which the packed layout does not have;
- a shard of bytes that are not floating point: FSDP2 cannot make a parameter of uint8.
What remains trains as one process does: ddp holds every weight whole; FSDP2 and ZeRO-3 shard a 4-bit weight's
float storage (`bnb_4bit_quant_storage`) as flat numbers and gather it back unchanged, where bitsandbytes' layer
re-attaches its quantization state (measured: tests/models/test_finetune_runs.py, the same losses as ddp's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lightning_dist._compat.bitsandbytes import keep_4bit_layout, quantized_kind, relaid_out
from lightning_dist.parallel.sizes import ParallelSizes

# The dtype each "-true" precision converts the whole model to (Lightning's `convert_module`).
CONVERTED = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}


@dataclass(frozen=True)
class QuantizedSupport:
    """How a strategy, as configured, holds a quantized base. `refusal`: why it cannot hold one at all (the end of
    the one-line refusal), else None. `shards`: it shards weights as flat numbers (FSDP2, ZeRO-3). `holds_in`: the
    dtype it casts or gathers every parameter in, None where it keeps the model's dtypes."""

    refusal: str | None = None
    shards: bool = False
    holds_in: torch.dtype | None = None


def data_parallel_support(sizes: ParallelSizes, shards: bool, holds_in: torch.dtype | None) -> QuantizedSupport:
    """FSDP2's or DeepSpeed's support under `sizes`: over data-parallel ranks only. Splitting a weight (tensor
    parallelism) breaks its packed layout; pipeline, context and expert parallelism have not been measured with one."""
    others = [f"{key}={getattr(sizes, name)}" for name, key in ParallelSizes.KEYS.items()
              if name in ("tensor", "context", "pipeline", "expert") and getattr(sizes, name) not in (1, None)]
    if others:
        return QuantizedSupport(refusal=f"which lightning-dist shards over data-parallel ranks only, not with"
                                        f" {', '.join(others)}: train it with those sizes at 1, or under ld_ddp")
    return QuantizedSupport(shards=shards, holds_in=holds_in)


def quantized_weights(module: nn.Module) -> list[tuple[str, str, torch.dtype]]:
    """(name, "4-bit" or "8-bit", storage dtype) of each of `module`'s quantized parameters."""
    return [(name, kind, param.dtype) for name, param in module.named_parameters()
            if (kind := quantized_kind(param)) is not None]


def check_quantized_weights(module: nn.Module, strategy: str, support: QuantizedSupport, precision: str | None) -> None:
    """Stop, in one line, where `strategy` would rewrite `module`'s quantized weights as numbers."""
    found = quantized_weights(module)
    if not found:
        return
    name, kind, dtype = found[0]
    what = f"{name} is a bitsandbytes {kind} weight stored as {dtype}"
    if support.refusal is not None:
        raise ValueError(f"{strategy}: {what}, {support.refusal}")
    if kind != "4-bit" and (support.shards or support.holds_in is not None):
        raise ValueError(f"{strategy}: {what}, which lightning-dist trains under ld_ddp only (its row scales beside it"
                         " have not been measured under a sharding or casting engine)")
    wanted = support.holds_in or CONVERTED.get(precision or "") or torch.bfloat16
    if support.shards and not dtype.is_floating_point:
        raise ValueError(
            f"{strategy}: {what}, which this strategy would shard as numbers and train silently wrong (accelerate"
            f" #3983); it shards 4-bit weights stored as floats: load the base with"
            f" BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_storage={wanted}), or train it under ld_ddp")
    if support.holds_in is not None and dtype.is_floating_point and dtype != support.holds_in:
        raise ValueError(
            f"{strategy}: {what}, which this strategy holds in {support.holds_in} (precision={precision}) and would"
            f" rewrite as numbers; load the base with bnb_4bit_quant_storage={support.holds_in}")
    target = CONVERTED.get(precision or "")
    if target is not None and dtype.is_floating_point and dtype != target:
        raise ValueError(
            f"precision={precision}: {what}, which converting the model to {target} would rewrite as numbers; use a"
            f" precision that keeps the model's dtypes (32-true, bf16-mixed) or a bnb_4bit_quant_storage of {target}")


def keep_quantized_layout(module: nn.Module, sharded: bool) -> None:
    """Keep every 4-bit weight in the layout it was quantized in; where it is `sharded`, check after each forward
    that it stayed.

    bitsandbytes' CPU kernels re-lay a 4-bit weight's bytes in place on an eval-mode forward without gradients (the
    first validation batch, or a model transformers left in eval mode) and mark the layer's quantization state so.
    A weight that FSDP2 or ZeRO-3 gathers afresh from its shards loses the new layout and keeps the mark: measured
    under FSDP2 on 2 ranks, the second step's loss 2.3410 where ddp's is 2.1443, with no error. Turned off in every
    strategy, so that a 4-bit layer computes the same way under each."""
    for layer_name, layer in keep_4bit_layout(module):
        if sharded:
            layer.register_forward_hook(_stayed_in_layout(layer_name))


def _stayed_in_layout(layer_name: str):
    def check(layer: nn.Module, inputs: object, output: object) -> None:
        if relaid_out(layer):
            raise ValueError(
                f"{layer_name}: bitsandbytes re-laid its 4-bit weight out for its CPU kernel although told not to"
                " (Linear4bit.support_avx512bf16_for_cpu), which a sharded weight does not keep; this bitsandbytes"
                " is not one lightning-dist was checked on (0.50): train the quantized base under ld_ddp")
    return check
