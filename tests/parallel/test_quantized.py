"""Quantized base weights (bitsandbytes' 4-bit layers, QLoRA's base) are trained only where they stay as
bitsandbytes made them: a strategy that shards or casts them, or a precision that converts their float storage to
another dtype, stops in one line (lightning_dist/parallel/quantized.py). QLoRA's runs: tests/models/test_finetune_runs.py."""

from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch
from torch import nn

from lightning_dist.parallel.quantized import check_quantized_weights, quantized_weights


def four_bit(storage: torch.dtype) -> nn.Module:
    layer = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.float32, quant_storage=storage)
    layer.weight = bnb.nn.Params4bit(torch.randn(64, 64), requires_grad=False, quant_storage=storage)
    return nn.Sequential(nn.Linear(64, 64), layer.to("cpu"))  # `.to` quantizes


def test_the_4_bit_weights_are_found_by_their_class_whatever_their_storage():
    assert quantized_weights(four_bit(torch.uint8)) == [("1.weight", "4-bit", torch.uint8)]
    assert quantized_weights(four_bit(torch.bfloat16)) == [("1.weight", "4-bit", torch.bfloat16)]
    assert quantized_weights(nn.Linear(4, 4)) == []


def test_a_sharding_strategy_refuses_them_naming_the_weight():
    with pytest.raises(ValueError) as refused:
        check_quantized_weights(four_bit(torch.bfloat16), "ld_fsdp", keeps_them_whole=False, precision="bf16-mixed")
    assert str(refused.value).startswith("ld_fsdp: 1.weight is a bitsandbytes 4-bit weight stored as torch.bfloat16,"
                                         " which this strategy would shard or cast as numbers")
    check_quantized_weights(nn.Linear(4, 4), "ld_fsdp", keeps_them_whole=False, precision="bf16-mixed")


@pytest.mark.parametrize(("storage", "precision", "refused"), [
    (torch.float32, "bf16-true", True),  # converted to bf16: the packed shape doubles ("shape '[64, 32]' is invalid")
    (torch.bfloat16, "16-true", True),
    (torch.float32, "bf16-mixed", False),  # the model keeps its dtypes
    (torch.bfloat16, "bf16-true", False),  # already the target dtype
    (torch.uint8, "bf16-true", False),  # `module.to(dtype)` casts floating-point parameters only
])
def test_ddp_keeps_them_unless_a_true_precision_converts_their_float_storage(storage, precision, refused):
    model = four_bit(storage)
    if refused:
        with pytest.raises(ValueError, match=rf"^precision={precision}: 1.weight is a bitsandbytes 4-bit weight stored"
                                             rf" as {storage}, which converting the model to torch.\w+ would rewrite"):
            check_quantized_weights(model, "ld_ddp", keeps_them_whole=True, precision=precision)
    else:
        check_quantized_weights(model, "ld_ddp", keeps_them_whole=True, precision=precision)


def test_the_conversion_the_precision_check_stands_for_breaks_a_4_bit_layer():
    model, x = four_bit(torch.float32), torch.randn(2, 64)
    model(x)
    converted = model.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="is invalid for input of size"):
        converted(x.bfloat16())
