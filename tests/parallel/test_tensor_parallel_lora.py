"""A PEFT model's tensor-parallel plan: the model inside keeps its own plan (PEFT's wrapper hands on its attributes),
and each LoRA layer the plan names is split as Megatron-LM splits LoRA (in process: the plan only; the two-rank
losses are tests/models/test_finetune_runs.py's)."""

from __future__ import annotations

import pytest
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_dist.parallel.tensor_parallel import find_plan, resolve_plan

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2)


def peft_llama(**lora):
    return get_peft_model(LlamaForCausalLM(CONFIG), LoraConfig(r=4, target_modules=["q_proj", "o_proj"], **lora))


def test_the_plan_is_the_model_s_own_with_its_patterns_from_the_wrapper():
    source, plan = find_plan(peft_llama(), None)
    # PeftModel answers `tp_plan` with the Llama's, whose patterns start at the Llama: found where it belongs.
    assert source == "LlamaForCausalLM.tp_plan"
    assert plan["base_model.model.model.layers.*.self_attn.q_proj"] == "colwise"


def test_a_lora_layer_is_split_as_its_base_layer_and_the_factor_that_meets_the_split():
    plan = resolve_plan(peft_llama(), None, 2)
    attention = "base_model.model.model.layers.0.self_attn"
    # colwise q_proj: its base and B (r -> out) by output features; A whole.
    assert plan[f"{attention}.q_proj.base_layer"] == plan[f"{attention}.q_proj.lora_B.default"] == "colwise"
    # rowwise o_proj: its base and A (in -> r) by input features; B whole.
    assert plan[f"{attention}.o_proj.base_layer"] == plan[f"{attention}.o_proj.lora_A.default"] == "rowwise"
    assert not any(name.endswith((".q_proj", ".o_proj", "q_proj.lora_A.default", "o_proj.lora_B.default"))
                   for name in plan)
    # The layers LoRA leaves alone keep the plan's own patterns.
    assert plan["base_model.model.model.layers.*.self_attn.k_proj"] == "colwise"
    assert plan["base_model.model.model.layers.*.mlp.down_proj"] == "rowwise"


def test_dora_on_a_planned_layer_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^LlamaForCausalLM.tp_plan: base_model.model.model.layers.0.self_attn.q_proj"
                                         r" is PEFT's Linear, which tensor parallelism does not split: only LoRA's"
                                         r" Linear layers \(not DoRA's\)"):
        resolve_plan(peft_llama(use_dora=True), None, 2)


def test_a_frozen_layer_stays_frozen_when_split_or_kept_whole_with_its_gradients_summed():
    """torch's SequenceParallel (a per-head norm's style) makes each parameter anew as a trainable one: Qwen3's norms,
    frozen under LoRA, then trained, silently (measured: 1e-5 off the data-parallel losses at step 1 under fsdp_tp).
    Each parameter keeps its requires_grad through the split, on a one-rank mesh as on any."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from lightning_dist.parallel.tensor_parallel import apply_tensor_parallel
    from tests.conftest import one_rank_world

    qwen3 = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    model = get_peft_model(qwen3, LoraConfig(r=4, target_modules="all-linear"))
    trainable = {name: param.requires_grad for name, param in model.named_parameters()}
    assert sum(trainable.values()) == 28  # the adapters of 7 layers in each of 2 blocks: A and B
    with one_rank_world():
        apply_tensor_parallel(model, init_device_mesh("cpu", (1,)), resolve_plan(model, None, 1))
        norm = model.base_model.model.model.layers[0].self_attn.q_norm.weight
        assert isinstance(norm, DTensor)  # kept whole, its gradient to be summed
        assert {name: param.requires_grad for name, param in model.named_parameters()} == trainable
