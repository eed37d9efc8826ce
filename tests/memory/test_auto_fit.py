"""auto_fit climbs the ladder from the least sharding and stops at the first rung that fits."""

from __future__ import annotations

import dataclasses
import logging

import pytest

import lightning_dist  # noqa: F401
from lightning_dist.memory import AutoFit, ModelFacts, NothingFits
from lightning_dist.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy

# 7B parameters in 32 blocks of 200M; one micro-batch saves 8 GB of fp32 activations (4 GB in bf16).
SEVEN_B = ModelFacts(parameters=7_000_000_000, largest_block=200_000_000, activation_bytes=8_000_000_000,
                     checkpointed_activation_bytes=2_000_000_000)
# The same with a tensor-parallel plan that splits 6.4B of the 7B (its blocks' linear layers), at twice the batch.
SEVEN_B_PLANNED = ModelFacts(parameters=7_000_000_000, largest_block=200_000_000, activation_bytes=16_000_000_000,
                             checkpointed_activation_bytes=2_000_000_000, tensor_parallel_parameters=6_400_000_000)
# 1B parameters in 32 blocks, without a tensor-parallel plan, at a context whose activations are 60 GB in fp32.
LONG_CONTEXT_1B = ModelFacts(parameters=1_000_000_000, largest_block=31_000_000, blocks=32, activation_bytes=60_000_000_000,
                             checkpointed_activation_bytes=4_000_000_000, tensor_parallel_parameters=0)
LONG_CONTEXT_1B_TRACED = dataclasses.replace(LONG_CONTEXT_1B, attention=(16, 16, 32768), positions=True)
TINY = ModelFacts(parameters=842_496, largest_block=198_272, activation_bytes=88_261_636)


@pytest.mark.parametrize(("facts", "fit", "chosen", "rejected"), [
    (TINY, AutoFit(device_memory_gb=1), "ddp", []),
    (SEVEN_B, AutoFit(device_memory_gb=80), "deepspeed_stage_2", ["ddp"]),
    (SEVEN_B, AutoFit(device_memory_gb=40), "deepspeed_stage_3", ["ddp", "deepspeed_stage_2"]),
    (SEVEN_B, AutoFit(device_memory_gb=24, host_memory_gb=512), "deepspeed_stage_3_offload",
     ["ddp", "deepspeed_stage_2", "deepspeed_stage_3"]),
    (SEVEN_B, AutoFit(device_memory_gb=24, host_memory_gb=64, nvme_path="/local_nvme"), "deepspeed_stage_3_offload_nvme",
     ["ddp", "deepspeed_stage_2", "deepspeed_stage_3", "deepspeed_stage_3_offload"]),
    (SEVEN_B, AutoFit(device_memory_gb=80, family="fsdp"), "fsdp_shard_grad_op", ["ddp"]),
    (SEVEN_B, AutoFit(device_memory_gb=40, family="fsdp"), "fsdp", ["ddp", "fsdp_shard_grad_op"]),
    # On 8 devices FSDP holds 20.1 GB per device at backward's start: 8.0 GB activations (no gradients yet), 0.8 GB
    # two gathered blocks and 0.8 one block's gradients being reduce-scattered; split over 2 ranks as well, 17.4 GB:
    # more sharded state (4 data-parallel ranks, not 8), half the gathered blocks and the reduce-scatter buffer, and
    # two thirds of the activations. 21.7 GB x 0.85 = 18.4 GB usable.
    (SEVEN_B_PLANNED, AutoFit(device_memory_gb=21.7, host_memory_gb=512, family="fsdp"), "fsdp_tp",
     ["ddp", "fsdp_shard_grad_op", "fsdp", "fsdp_ep"]),
    (dataclasses.replace(SEVEN_B_PLANNED, tensor_parallel_parameters=0), AutoFit(device_memory_gb=21.7, host_memory_gb=512, family="fsdp"),
     "fsdp_cpu_offload", ["ddp", "fsdp_shard_grad_op", "fsdp", "fsdp_ep", "fsdp_tp", "fsdp_cp", "fsdp_pp"]),
    # Long sequences: activations outweigh the model. FSDP on 8 devices holds all 30 GB of one micro-batch's bf16
    # activations; 2 pipeline stages hold half each (1F1B: 2 micro-batches of half the batch in flight), beside
    # their stage's 0.5B parameters gathered (1 GB) and its gradients accumulated in fp32 (2 GB): 19.7 of 20.4 GB.
    # (Facts given without an attention trace: the sequences cannot be split, fsdp_cp is passed over.)
    (LONG_CONTEXT_1B, AutoFit(device_memory_gb=24, host_memory_gb=512, family="fsdp"), "fsdp_pp",
     ["ddp", "fsdp_shard_grad_op", "fsdp", "fsdp_ep", "fsdp_tp", "fsdp_cp"]),
    # The same model as traced (16 heads, 32,768 tokens, rotary positions): each sequence split over 2 ranks holds
    # half the activations, 15 GB, beside its 1.5 GB of sharded state (16.7 of 20.4 GB): the weights stay sharded over
    # all 8 ranks.
    (LONG_CONTEXT_1B_TRACED, AutoFit(device_memory_gb=24, host_memory_gb=512, family="fsdp"), "fsdp_cp",
     ["ddp", "fsdp_shard_grad_op", "fsdp", "fsdp_ep", "fsdp_tp"]),
])
def test_auto_fit_picks_the_least_sharded_strategy_that_fits(facts, fit, chosen, rejected, caplog):
    devices = 2 if facts is TINY else 4 if facts is SEVEN_B else 8
    with caplog.at_level(logging.INFO, logger="lightning_dist.memory.auto_fit"):
        choice = fit.choose(facts, "32-true" if facts is TINY else "bf16-mixed", devices)
    assert choice.name == chosen
    assert [name for name, _ in choice.rejected] == rejected
    expected_class = DDPStrategy if chosen == "ddp" else FSDPStrategy if chosen.startswith("fsdp") else DeepSpeedStrategy
    assert isinstance(choice.strategy, expected_class)
    logged = [r.getMessage() for r in caplog.records]
    assert logged[-1].startswith(f"auto_fit: chose {chosen}: ")
    assert [line.split(":")[1].strip() for line in logged[:-1]] == [f"not {name}" for name in rejected]


def test_rejections_say_what_was_needed_and_what_was_usable():
    choice = AutoFit(device_memory_gb=40).choose(SEVEN_B, "bf16-mixed", 4)
    assert dict(choice.rejected) == {
        "ddp": "needs 140.00 GB per device, 34.00 GB usable",  # the bucket rebuild outweighs activations and copies
        "deepspeed_stage_2": "needs 43.30 GB per device, 34.00 GB usable",  # with its two 0.4 GB gradient buckets
    }
    assert choice.strategy.config["zero_optimization"]["stage"] == 3


@pytest.mark.parametrize(("traced", "why"), [
    ({}, "the model makes no F.scaled_dot_product_attention call for context parallelism to exchange"),
    ({"attention": (16, 16, 32768)}, "the model has no position embedding or rotary table for a shard's positions"),
    ({"attention": (16, 3, 32768), "positions": True}, "its attention's 16 query and 3 key/value heads do not divide by 2"),
    ({"attention": (16, 16, 32766), "positions": True}, "its 32766-token sequences do not split into 4 chunks"),
])
def test_the_context_parallel_rung_is_passed_over_where_the_sequences_cannot_split(traced, why):
    facts = dataclasses.replace(LONG_CONTEXT_1B, **traced)
    choice = AutoFit(device_memory_gb=24, host_memory_gb=512, family="fsdp").choose(facts, "bf16-mixed", 8)
    assert dict(choice.rejected)["fsdp_cp"] == why and choice.name == "fsdp_pp"


def test_the_model_trace_gives_context_parallelism_its_heads_length_and_positions():
    import torch

    from lightning_dist.models.gpt import GPTLanguageModel, TransformerBlock

    batch = (torch.zeros(2, 256, dtype=torch.long), torch.zeros(2, 256, dtype=torch.long))
    facts = ModelFacts.of(lambda: GPTLanguageModel(vocab_size=256, block_size=256, n_layer=2, n_head=4, d_model=64),
                          batch, (TransformerBlock,))
    assert facts.attention == (4, 4, 256) and facts.positions


def test_when_nothing_fits_every_rung_is_named():
    with pytest.raises(NothingFits) as error:
        AutoFit(device_memory_gb=24, host_memory_gb=64).choose(SEVEN_B, "bf16-mixed", 4)
    message = str(error.value)
    assert message.startswith("strategy=auto_fit: nothing fits: ddp: needs")
    # 16 bytes per parameter, and fp32 copies of the gradient partitions for the host optimizer's step (4 more)
    assert "deepspeed_stage_3_offload: needs 140.00 GB of host memory per node, 54.40 GB usable" in message
    assert message.endswith("deepspeed_stage_3_offload_nvme: no strategy.nvme_path to offload to")


@pytest.mark.parametrize(("option", "message"), [
    ({"family": "megatron"}, "strategy.family: 'megatron' is not a ladder; choose one of deepspeed, fsdp"),
    ({"headroom": 1.5}, "strategy.headroom: 1.5 must be in (0, 1]"),
])
def test_bad_options_are_named(option, message):
    with pytest.raises(ValueError, match=None) as error:
        AutoFit(**option)
    assert str(error.value) == message


def test_each_axis_rung_is_passed_over_for_the_reason_its_axis_gives():
    # No tensor-parallel plan, no attention call traced, 31 blocks for the preset's 2 stages.
    facts = dataclasses.replace(LONG_CONTEXT_1B, blocks=31)
    with pytest.raises(NothingFits) as error:
        AutoFit(device_memory_gb=24, host_memory_gb=512, family="fsdp").choose(facts, "bf16-mixed", 8)
    assert (" | fsdp_tp: the model has no tensor-parallel plan (a `tp_plan` attribute)"
            " | fsdp_cp: the model makes no F.scaled_dot_product_attention call for context parallelism to exchange"
            " | fsdp_pp: the model's 31 blocks do not divide into 2 pipeline stages | ") in str(error.value)
