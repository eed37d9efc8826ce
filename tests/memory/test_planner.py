"""The planner's arithmetic, on the canonical example and on models built on the meta device."""

from __future__ import annotations

from functools import partial

import pytest
import torch

import lightning_dist  # noqa: F401
from lightning_dist.memory import GB, ModelFacts, layout_of, plan_memory
from lightning_dist.memory.layout import Layout
from lightning_dist.models.gpt import GPTLanguageModel, TransformerBlock
from lightning_dist.parallel.activation_checkpoint import CheckpointPlan
from lightning_dist.strategies.presets import PRESETS


def preset_plan(name: str, facts: ModelFacts, precision: str = "bf16-mixed", devices: int = 4, num_nodes: int = 1):
    preset = PRESETS[name]
    return plan_memory(facts, layout_of(preset.strategy(**preset.kwargs), name), precision, devices=devices, num_nodes=num_nodes)


@pytest.mark.parametrize(("name", "gigabytes"), [
    ("ddp", 112.0),                # 16 bytes per parameter: fp32 weights and gradients under autocast, Adam's moments
    ("deepspeed_stage_1", 38.5),   # 2 + (2 + 12)/4: with overlap_comm DeepSpeed reduces gradients as ZeRO-2 does
    ("deepspeed_stage_2", 38.5),   # 2 + (2 + 12)/4
    ("deepspeed_stage_3", 28.0),   # 16/4
    ("fsdp", 28.0),                # (4 + 4 + 8)/4: fp32 shards, no separate master copy
])
def test_canonical_7b_mixed_precision_adam_on_4_devices(name, gigabytes):
    plan = preset_plan(name, ModelFacts(parameters=7_000_000_000))
    assert plan.model_state_per_device / GB == pytest.approx(gigabytes)


def test_categories_and_offload_destinations():
    facts = ModelFacts(parameters=7_000_000_000, largest_block=200_000_000)
    stage_2 = preset_plan("deepspeed_stage_2", facts)
    assert {k: v / GB for k, v in stage_2.device.items() if v} == {
        "parameters": 14.0, "gradients": 3.5, "optimizer_state": 21.0,
        "gradient_bucket": 0.8}  # two of Lightning's 2e8-element buckets in bf16: one fills while one is reduced
    offload = preset_plan("deepspeed_stage_3_offload", facts, num_nodes=2)
    # Everything sharded over 8 ranks, then moved to the host: 4 ranks of each node add up there. The host optimizer
    # steps on fp32 copies of the bf16 gradient partitions: 6 bytes of gradients per parameter.
    assert {k: v / GB for k, v in offload.host.items()} == {"parameters": 7.0, "gradients": 21.0, "optimizer_state": 42.0}
    assert offload.model_state_per_device == 0
    assert offload.device["gathered_parameters"] / GB == pytest.approx(0.8)  # a block and the next, in bf16
    nvme = preset_plan("deepspeed_stage_3_offload_nvme", facts)
    # On the drive: parameters and optimizer state. In host memory: the gradient partitions (DeepSpeed swaps only
    # the optimizer state) and the buffers optimizer state is swapped through: 4 of one 2.5e7-element sub-group.
    assert sum(nvme.nvme.values()) / GB == pytest.approx(98.0)
    assert {k: v / GB for k, v in nvme.host.items() if v} == {"gradients": 42.0, "optimizer_swap_buffers": pytest.approx(1.6)}


def test_planned_nvme_swap_pool_is_the_one_the_run_gets():
    from lightning_dist.strategies.deepspeed.config.swap_buffers import swap_buffers_sized_by_model

    size = {"d_model": 2560, "n_layer": 26, "n_head": 20, "block_size": 64}
    facts = ModelFacts.of(lambda: GPTLanguageModel(**size))
    plan = preset_plan("deepspeed_stage_3_offload_nvme", facts, "32-true", devices=2)
    with torch.device("meta"):
        model = GPTLanguageModel(**size)
    preset = PRESETS["deepspeed_stage_3_offload_nvme"]
    config = swap_buffers_sized_by_model(preset.strategy(**preset.kwargs).config, model.modules(), world_size=2)
    pool = config["zero_optimization"]["offload_param"]
    # The largest partition is half an MLP matrix (4 x 2560 x 2560 / 2); the pool holds the reuse window's worth.
    assert pool["buffer_size"] == 4 * 2560 * 2560 // 2 and pool["max_in_cpu"] == 0
    assert plan.host["parameter_swap_buffers"] == pool["buffer_count"] * pool["buffer_size"] * 4 * 2
    assert plan.host["parameters_kept_in_host"] == 0


def test_precision_changes_what_each_engine_keeps():
    facts = ModelFacts(parameters=1_000_000_000)
    per_parameter = {
        (name, precision): preset_plan(name, facts, precision, devices=1).model_state_per_device / 1e9
        for name in ("ddp", "deepspeed_stage_2") for precision in ("32-true", "bf16-mixed", "bf16-true")
    }
    assert per_parameter == {
        ("ddp", "32-true"): 16, ("ddp", "bf16-mixed"): 16, ("ddp", "bf16-true"): 8,
        # DeepSpeed keeps an fp32 master copy even of fp32 weights.
        ("deepspeed_stage_2", "32-true"): 20, ("deepspeed_stage_2", "bf16-mixed"): 16, ("deepspeed_stage_2", "bf16-true"): 16,
    }


def test_model_facts_come_from_the_meta_device_and_a_traced_step():
    batch = (torch.zeros(16, 128, dtype=torch.long), torch.zeros(16, 128, dtype=torch.long))
    facts = ModelFacts.of(GPTLanguageModel, batch, (TransformerBlock,))
    real = GPTLanguageModel()
    assert facts.parameters == sum(p.numel() for p in real.parameters()) == 842_496  # tied head counted once
    assert facts.largest_block == sum(p.numel() for p in real.model.blocks[0].parameters())
    assert facts.optimizer == "adamw"
    assert ModelFacts.of(lambda: GPTLanguageModel(optimizer=partial(torch.optim.SGD, lr=0.1))).optimizer == "sgd"
    # Checkpointing keeps block inputs (4 x 16 x 128 x 128 floats) instead of what each block saves inside.
    assert 0 < facts.checkpointed_activation_bytes < facts.activation_bytes / 2
    assert facts.activation_bytes > 16 * 128 * 256 * 4  # at least the logits


def test_zero_3_counts_its_gradient_bucket():
    plan = preset_plan("deepspeed_stage_3", ModelFacts(parameters=1_000_000), "32-true", devices=2)
    assert plan.device["gradient_bucket"] == 200_000_000 * 4  # allocated whole at start-up: Lightning's 2e8 elements
    # A model with a hidden size gets the bucket the run will get: h^2 elements, Hugging Face's "auto" rule.
    sized = preset_plan("deepspeed_stage_3", ModelFacts(parameters=1_000_000, hidden_size=512), "32-true", devices=2)
    assert sized.device["gradient_bucket"] == 512 * 512 * 4


def test_activation_checkpointing_shrinks_activations_in_the_plan():
    batch = (torch.zeros(8, 128, dtype=torch.long), torch.zeros(8, 128, dtype=torch.long))
    facts = ModelFacts.of(GPTLanguageModel, batch, (TransformerBlock,))
    plain, checkpointed = (preset_plan(n, facts, "32-true", devices=2) for n in ("fsdp", "fsdp_activation_checkpointing"))
    assert plain.device["activations"] == facts.activation_bytes
    assert checkpointed.device["activations"] == facts.checkpointed_activation_bytes


def test_selective_checkpointing_plans_between_none_and_every_block():
    batch = (torch.zeros(8, 128, dtype=torch.long), torch.zeros(8, 128, dtype=torch.long))
    facts = ModelFacts.of(GPTLanguageModel, batch, (TransformerBlock,))
    blocks = facts.block_activations
    assert len(blocks) == 4 and all(0 < b.inputs < b.products < b.saved for b in blocks)
    none, full, ops, every_2 = (facts.activations_under(plan) for plan in
                                (None, CheckpointPlan(), CheckpointPlan(ops=True), CheckpointPlan(every=2)))
    assert (none, full) == (facts.activation_bytes, facts.checkpointed_activation_bytes)
    assert full < ops < none and full < every_2 < none
    # Every other block: two of the four blocks keep only their inputs; one is recomputed at a time.
    saved, inputs = blocks[0].saved, blocks[0].inputs
    assert every_2 == none - 2 * (saved - inputs) + saved
    layout = Layout("fsdp", "torch", shard_parameters=True, shard_gradients=True, shard_optimizer=True,
                    activation_checkpointing=CheckpointPlan(ops=True))
    assert plan_memory(facts, layout, "32-true", devices=2).device["activations"] == ops


def test_traced_attention_saves_what_a_fused_kernel_saves():
    # The fused kernels save q, k, v, the output and a row per query: linear in the context. Meta's math path would
    # save the (T x T) weights too, and a block would save more than twice as much at twice the context.
    def block_at(context: int):
        batch = (torch.zeros(8, context, dtype=torch.long),) * 2
        return ModelFacts.of(partial(GPTLanguageModel, block_size=256), batch, (TransformerBlock,)).block_activations[0]

    short, long = block_at(128), block_at(256)
    assert (long.saved, long.products, long.inputs) == (2 * short.saved, 2 * short.products, 2 * short.inputs)


def test_zero_3_keeps_parameters_under_its_persistence_threshold_whole():
    facts = ModelFacts.of(GPTLanguageModel)  # every parameter of the tiny GPT has fewer than 1e5 elements
    assert max(facts.parameter_sizes) < 100_000 and sum(facts.parameter_sizes) == facts.parameters
    plan = preset_plan("deepspeed_stage_3", facts, "32-true", devices=2)
    assert (plan.device["parameters"], plan.device["persistent_parameters"]) == (facts.parameters * 4 / 2, facts.parameters * 4)
    big = ModelFacts.of(lambda: GPTLanguageModel(d_model=512, n_head=8))  # its 512 x 2048 matrices are partitioned only
    persistent = sum(n for n in big.parameter_sizes if n < 100_000)
    plan = preset_plan("deepspeed_stage_3", big, "32-true", devices=2)
    assert (plan.device["parameters"], plan.device["persistent_parameters"]) == (big.parameters * 2, persistent * 4)


def test_autocast_keeps_a_16_bit_copy_of_every_weight_under_ddp_only():
    facts = ModelFacts(parameters=1_000_000, largest_block=100_000, activation_bytes=4_000_000)
    assert preset_plan("ddp", facts, "bf16-mixed").device["autocast_weight_copies"] == 2_000_000
    assert "autocast_weight_copies" not in preset_plan("ddp", facts, "32-true").device
    assert "autocast_weight_copies" not in preset_plan("fsdp", facts, "bf16-mixed").device  # gathers in bf16 itself


def test_fsdp_s_peak_holds_the_larger_of_gradients_and_activations_and_one_block_being_reduce_scattered():
    activation_heavy = ModelFacts(parameters=1_000_000, largest_block=100_000, activation_bytes=40_000_000)
    plan = preset_plan("fsdp", activation_heavy, "32-true", devices=4)
    assert plan.device["reduce_scatter_buffer"] == 100_000 * 4
    assert plan.off_peak == {"gradients": 1_000_000 * 4 / 4} and "gradients" not in plan.device
    assert plan.model_state_per_device == 1_000_000 * 16 / 4  # the gradients still count as model state
    state_heavy = ModelFacts(parameters=1_000_000, largest_block=100_000, activation_bytes=4_000)
    assert "activations" in preset_plan("fsdp", state_heavy, "32-true", devices=4).off_peak


def lora_llama():
    """A transformers Llama with PEFT's LoRA on its attention, built as users build it."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def test_a_lora_model_s_plan_holds_its_frozen_base_as_weights_only():
    """The base of a LoRA model is held whole (or sharded) but has no gradients and no optimizer state: leaving it
    out planned a 7B fine-tune without its 7B weights."""
    facts = ModelFacts.of(lora_llama)
    real = lora_llama()
    adapters = sum(p.numel() for p in real.parameters() if p.requires_grad)
    base = sum(p.numel() for p in real.parameters() if not p.requires_grad)
    # r 4 on q (64 -> 64: 4 x 64 + 64 x 4) and v (64 -> 32: 4 x 64 + 32 x 4), in each of 2 layers.
    assert (facts.parameters, facts.frozen_parameters) == (adapters, base) == (2 * (512 + 384), base)
    assert sum(facts.parameter_sizes) == adapters + base
    ddp = preset_plan("ddp", facts, "32-true", devices=2)
    assert ddp.device["parameters"] == (adapters + base) * 4
    assert ddp.device["gradients"] == adapters * 4 and ddp.device["optimizer_state"] == adapters * 8
    zero3 = preset_plan("deepspeed_stage_3", facts, "bf16-mixed", devices=2)
    assert zero3.device["parameters"] == (adapters + base) * 2 / 2  # 16-bit partitions of every weight
    assert zero3.device["optimizer_state"] == adapters * 12 / 2  # fp32 master and Adam's moments: adapters only
    # Tensor parallelism splits the frozen q/k/v/o and MLP weights of the blocks as it splits trained ones.
    assert facts.tensor_parallel_frozen > 0
    assert preset_plan("fsdp_tp", facts, "32-true").device["parameters"] < preset_plan("fsdp", facts, "32-true", devices=2).device["parameters"]


def test_a_lora_base_held_in_bf16_is_planned_in_bf16():
    """transformers loads a checkpoint in its bf16, PEFT makes the adapters float32, and every engine keeps the frozen
    base as loaded where the precision holds the rest in float32: 2 bytes a base weight, not 4."""
    def bf16_lora():
        model = lora_llama()
        for name, parameter in model.named_parameters():
            if "lora_" not in name:
                parameter.data = parameter.data.bfloat16()
        return model

    facts = ModelFacts.of(bf16_lora)
    adapters, base = facts.parameters, facts.frozen_parameters
    assert facts.frozen_16bit_parameters == base and ModelFacts.of(lora_llama).frozen_16bit_parameters == 0
    assert preset_plan("ddp", facts, "32-true", devices=2).device["parameters"] == base * 2 + adapters * 4
    assert preset_plan("fsdp", facts, "bf16-mixed", devices=2).device["parameters"] == (base * 2 + adapters * 4) / 2
    zero3 = preset_plan("deepspeed_stage_3", facts, "bf16-mixed", devices=2)
    assert zero3.device["parameters"] == (adapters + base) * 2 / 2  # DeepSpeed's bf16 config: every weight in bf16


def test_plan_true_counts_a_lora_model_s_base(tmp_path):
    from lightning_dist.run.preset_table import parameter_count

    facts = ModelFacts.of(lora_llama)
    assert parameter_count(facts) == f"{facts.parameters:,} trained of {facts.parameters + facts.frozen_parameters:,} parameters"
    assert parameter_count(ModelFacts(parameters=1_000)) == "1,000 parameters"


def test_a_pretrained_model_is_planned_without_reading_its_weights_and_with_its_load_peak(tmp_path):
    """Planning built the model from its folder and read every tensor (an 8B model: its 16 GB read to plan it); now
    the weights stay in the folder, and the host memory the ranks hold while they read them (their rows of the largest
    tensor under fsdp and ZeRO-3, about twice the whole of it elsewhere, in the run's dtype, BENCHMARKS.md) is in the plan beside the offloaded state, never with it."""
    from unittest import mock

    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_dist.models.pretrained import from_pretrained
    from lightning_dist.parallel.pretrained_weights import PretrainedFolder
    from lightning_dist.run.preset_table import compare_presets

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    with mock.patch.object(PretrainedFolder, "read", side_effect=AssertionError("read while planning")):
        facts = ModelFacts.of(partial(from_pretrained, tmp_path))
    assert facts.pretrained_largest == 256 * 64  # the embedding and the head
    fsdp = preset_plan("fsdp", facts, "32-true", devices=4)
    # Each of 4 ranks reads its rows of a tensor, a quarter of it, in fp32.
    assert fsdp.loading == {"pretrained_tensors": (256 * 64 // 4) * 4 * 4}
    assert fsdp.host_peak == fsdp.loading["pretrained_tensors"]
    assert "| host, per node, while the pretrained weights load | pretrained_tensors | 0.000 |" in fsdp.table()
    zero3 = preset_plan("deepspeed_stage_3", facts, "32-true", devices=4)
    assert zero3.loading == fsdp.loading  # the rows that hold its partition
    zero2 = preset_plan("deepspeed_stage_2", facts, "32-true", devices=4)
    assert zero2.loading == {"pretrained_tensors": 2 * 256 * 64 * 4 * 4}  # each rank the whole tensor, twice
    offload = preset_plan("deepspeed_stage_3_offload", facts, "32-true", devices=4)
    assert offload.host_peak == max(offload.host_total, offload.loading["pretrained_tensors"])
    assert "while they read the pretrained weights" in compare_presets(facts, "32-true", 4)
    assert preset_plan("fsdp", ModelFacts.of(lora_llama), "32-true", devices=4).loading == {}
