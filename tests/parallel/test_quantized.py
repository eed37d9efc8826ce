"""Quantized base weights (bitsandbytes' 4-bit layers, QLoRA's base) are trained only where they stay as
bitsandbytes made them: a strategy that would split, cast or shard their bytes as numbers, or a precision that
converts their float storage to another dtype, stops in one line (lightning_dist/parallel/quantized.py); each 4-bit
layer keeps the layout it was quantized in. QLoRA's runs: tests/models/test_finetune_runs.py."""

from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch
from torch import nn

from lightning_dist._compat.bitsandbytes import relaid_out
from lightning_dist.parallel.quantized import (
    QuantizedSupport,
    check_quantized_weights,
    data_parallel_support,
    keep_quantized_layout,
    quantized_weights,
)
from lightning_dist.parallel.sizes import ParallelSizes
from tests.conftest import cpu_has_bf16

WHOLE = QuantizedSupport()
SHARDED_FP32 = QuantizedSupport(shards=True)


def four_bit(storage: torch.dtype) -> nn.Module:
    layer = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.float32, quant_storage=storage)
    layer.weight = bnb.nn.Params4bit(torch.randn(64, 64), requires_grad=False, quant_storage=storage)
    return nn.Sequential(nn.Linear(64, 64), layer.to("cpu"))  # `.to` quantizes


def test_the_4_bit_weights_are_found_by_their_class_whatever_their_storage():
    assert quantized_weights(four_bit(torch.uint8)) == [("1.weight", "4-bit", torch.uint8)]
    assert quantized_weights(four_bit(torch.bfloat16)) == [("1.weight", "4-bit", torch.bfloat16)]
    assert quantized_weights(nn.Linear(4, 4)) == []


def test_a_strategy_that_cannot_hold_them_refuses_them_naming_the_weight():
    with pytest.raises(ValueError) as refused:
        check_quantized_weights(four_bit(torch.bfloat16), "ld_x", QuantizedSupport(refusal="which it splits"),
                                precision="bf16-mixed")
    assert str(refused.value) == "ld_x: 1.weight is a bitsandbytes 4-bit weight stored as torch.bfloat16, which it splits"
    check_quantized_weights(nn.Linear(4, 4), "ld_x", QuantizedSupport(refusal="which it splits"), "bf16-mixed")


def test_sharded_they_must_be_4_bit_in_a_float_storage_of_the_dtype_the_engine_holds():
    with pytest.raises(ValueError, match=r"^ld_fsdp: 1.weight is a bitsandbytes 4-bit weight stored as torch.uint8,"
                                         r" which this strategy would shard as numbers .* bnb_4bit_quant_storage="
                                         r"torch.bfloat16\), or train it under ld_ddp$"):
        check_quantized_weights(four_bit(torch.uint8), "ld_fsdp", SHARDED_FP32, precision="32-true")
    check_quantized_weights(four_bit(torch.float32), "ld_fsdp", SHARDED_FP32, precision="32-true")
    check_quantized_weights(four_bit(torch.bfloat16), "ld_fsdp", SHARDED_FP32, precision="32-true")
    gathers_bf16 = QuantizedSupport(shards=True, holds_in=torch.bfloat16)  # FSDP2 under bf16-mixed, ZeRO-3 in bf16
    with pytest.raises(ValueError, match=r"^ld_deepspeed: 1.weight is a bitsandbytes 4-bit weight stored as"
                                         r" torch.float32, which this strategy holds in torch.bfloat16"
                                         r" \(precision=bf16-mixed\) and would rewrite as numbers; load the base with"
                                         r" bnb_4bit_quant_storage=torch.bfloat16$"):
        check_quantized_weights(four_bit(torch.float32), "ld_deepspeed", gathers_bf16, precision="bf16-mixed")
    check_quantized_weights(four_bit(torch.bfloat16), "ld_deepspeed", gathers_bf16, precision="bf16-mixed")


def test_an_8_bit_base_trains_under_ddp_only():
    layer = bnb.nn.Linear8bitLt(64, 64, has_fp16_weights=False)
    model = nn.Sequential(layer.to("cpu"))  # `.to` quantizes
    assert quantized_weights(model) == [("0.weight", "8-bit", torch.int8)]
    check_quantized_weights(model, "ld_ddp", WHOLE, precision="32-true")
    for support in (SHARDED_FP32, QuantizedSupport(holds_in=torch.float32)):  # FSDP2; DeepSpeed ZeRO-1/2
        with pytest.raises(ValueError, match=r"^ld_x: 0.weight is a bitsandbytes 8-bit weight stored as torch.int8,"
                                             r" which lightning-dist trains under ld_ddp only"):
            check_quantized_weights(model, "ld_x", support, precision="32-true")


def test_sharding_is_over_data_parallel_ranks_only():
    assert data_parallel_support(ParallelSizes(), shards=True, holds_in=None) == SHARDED_FP32
    assert data_parallel_support(ParallelSizes(replicate=2), shards=False, holds_in=torch.bfloat16) == (
        QuantizedSupport(holds_in=torch.bfloat16))
    split = data_parallel_support(ParallelSizes(tensor=2, context=2), shards=True, holds_in=None)
    assert split.refusal == ("which lightning-dist shards over data-parallel ranks only, not with"
                             " strategy.context_parallel_size=2, strategy.tensor_parallel_size=2: train it with those"
                             " sizes at 1, or under ld_ddp")


def eval_forward(model: nn.Module) -> None:
    model.eval()
    with torch.no_grad():
        model(torch.randn(2, 64))


def test_each_4_bit_layer_keeps_the_layout_it_was_quantized_in():
    """bitsandbytes' CPU kernel re-lays a 4-bit weight out in place on an eval-mode forward (where the CPU has
    AVX512-BF16), which shards gathered afresh do not keep."""
    left, kept = four_bit(torch.float32), four_bit(torch.float32)
    keep_quantized_layout(kept, sharded=True)
    eval_forward(left)
    eval_forward(kept)
    assert not relaid_out(kept[1])
    assert relaid_out(left[1]) == left[1].support_avx512bf16_for_cpu  # this CPU's kernel, where it has one
    assert cpu_has_bf16() or not left[1].support_avx512bf16_for_cpu


def test_a_sharded_layer_re_laid_out_all_the_same_stops_in_one_line():
    model = four_bit(torch.float32)
    keep_quantized_layout(model, sharded=True)
    model(torch.randn(2, 64))
    model[1].weight.quant_state.packing_format_for_cpu = True  # a bitsandbytes that re-lays out by another switch
    with pytest.raises(ValueError, match=r"^1: bitsandbytes re-laid its 4-bit weight out for its CPU kernel although"
                                         r" told not to .* train the quantized base under ld_ddp$"):
        model(torch.randn(2, 64))


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
            check_quantized_weights(model, "ld_ddp", WHOLE, precision=precision)
    else:
        check_quantized_weights(model, "ld_ddp", WHOLE, precision=precision)


def test_the_conversion_the_precision_check_stands_for_breaks_a_4_bit_layer():
    model, x = four_bit(torch.float32), torch.randn(2, 64)
    model(x)
    converted = model.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="is invalid for input of size"):
        converted(x.bfloat16())
