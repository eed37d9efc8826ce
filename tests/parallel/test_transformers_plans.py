"""transformers' own tensor-parallel plans beyond colwise and rowwise (in process: the plans; the two-rank losses are
tests/strategies/test_tensor_parallel.py's): Phi-3's and OLMo2's gathered outputs and split inputs, DeepSeek's latent
attention, whose rotary key's gradient is summed, and the output head, kept whole. What DeepSpeed AutoTP's name rules
cannot follow is refused in one line, and so is any split of GPT-OSS's heads (its sinks, one per head)."""

from __future__ import annotations

import pytest
from torch import nn
from transformers import (
    CodeGenConfig,
    CodeGenForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    FalconConfig,
    FalconForCausalLM,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
)

from lightning_dist.parallel.tensor_parallel import resolve_plan, rotary_key_layers
from lightning_dist.strategies.deepspeed.autotp import model_refusal

SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=None)


def deepseek_v3():
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        **{**SIZES, "num_key_value_heads": 4}, n_routed_experts=4, moe_intermediate_size=16, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=1, n_group=1, topk_group=1, num_experts_per_tok=2))


def test_phi3_s_fused_projections_are_split_with_their_outputs_gathered_and_their_inputs_split():
    attention, mlp = "model.layers.*.self_attn", "model.layers.*.mlp"
    assert resolve_plan(Phi3ForCausalLM(Phi3Config(**SIZES)), None, 2) == {
        f"{attention}.qkv_proj": "colwise_gather_output", f"{attention}.o_proj": "rowwise_split_input",
        f"{mlp}.gate_up_proj": "colwise_gather_output", f"{mlp}.down_proj": "rowwise_split_input"}


def test_the_output_head_stays_whole_and_tied_to_the_embedding():
    """The head's own style (colwise_gather_output) would split it, and a head tied to the embedding would no longer
    be: the head is left out of the plan."""
    model = LlamaForCausalLM(LlamaConfig(**{**SIZES, "tie_word_embeddings": True}))
    assert model.tp_plan["lm_head"] == "colwise_gather_output"
    plan = resolve_plan(model, None, 2)
    assert "lm_head" not in plan and plan["model.layers.*.self_attn.q_proj"] == "colwise"


def test_deepseek_s_latent_attention_sums_its_rotary_key_s_gradient_and_a_plan_that_splits_its_heads_must_too():
    model = deepseek_v3()
    attention = "model.layers.*.self_attn"
    plan = resolve_plan(model, None, 2)
    assert plan[f"{attention}.kv_a_proj_with_mqa"] == "mla_kv_a_proj"
    assert plan[f"{attention}.q_b_proj"] == plan[f"{attention}.kv_b_proj"] == "colwise"
    assert sorted(rotary_key_layers(model)) == [f"model.layers.{i}.self_attn.kv_a_proj_with_mqa" for i in range(2)]
    written = {f"{attention}.q_b_proj": "colwise", f"{attention}.kv_b_proj": "colwise", f"{attention}.o_proj": "rowwise"}
    with pytest.raises(ValueError) as refused:
        resolve_plan(model, written, 2)
    assert str(refused.value) == (
        f"strategy.tensor_parallel_plan: {attention}.q_b_proj splits the heads of {attention}.kv_a_proj_with_mqa,"
        " which DeepseekV3ForCausalLM.tp_plan keeps whole on every rank with their gradients summed over the"
        " tensor-parallel ranks (each rank's gradient is its own heads' part); add"
        f" '{attention}.kv_a_proj_with_mqa': mla_kv_a_proj to the plan, or leave the attention whole")


def test_autotp_refuses_in_one_line_a_plan_its_name_rules_cannot_follow():
    assert model_refusal(Olmo2ForCausalLM(Olmo2Config(**SIZES)), 2) == (
        "strategy.tensor_parallel_size=2: Olmo2ForCausalLM.tp_plan splits layers in colwise_gather_output,"
        " rowwise_split_input, which DeepSpeed AutoTP's name rules do not do (it reads no plan from a"
        " LightningModule); train it under strategy=fsdp_tp, which runs that plan, or with"
        " strategy.tensor_parallel_size=1")
    # Llama's is theirs; DeepSeek's latent attention is summed as planned (AutoTP keeps the layer whole)
    assert model_refusal(LlamaForCausalLM(LlamaConfig(**SIZES)), 2) is None
    assert model_refusal(deepseek_v3(), 2) is None


def test_autotp_refuses_a_fused_qkv_projection_whose_split_was_not_checked():
    """AutoTP's rules split a fused q/k/v projection by a layout guessed from its block's class: Falcon's (one key head)
    failed in a traceback inside the model, CodeGen's inside DeepSpeed (their 2-rank runs, before this refusal)."""
    sizes = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    assert model_refusal(FalconForCausalLM(FalconConfig(**sizes)), 2) == (
        "strategy.tensor_parallel_size=2: DeepSpeed AutoTP would split transformer.h.0.self_attention.query_key_value"
        " (FalconAttention) as a fused q/k/v projection by a guess at its heads' layout, checked right only in"
        " GPTNeoXAttention; train it with strategy.tensor_parallel_size=1")
    codegen = CodeGenForCausalLM(CodeGenConfig(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, vocab_size=64))
    assert model_refusal(codegen, 2).endswith(
        "; train it under strategy=fsdp_tp, which runs CodeGenForCausalLM.tp_plan, or with"
        " strategy.tensor_parallel_size=1")
    # GPT-NeoX's fused projection and OPT's separate ones (no plan) train one rank's losses at 2 ranks (measured)
    assert model_refusal(GPTNeoXForCausalLM(GPTNeoXConfig(**sizes, intermediate_size=64)), 2) is None
    assert model_refusal(OPTForCausalLM(OPTConfig(**sizes, ffn_dim=64, word_embed_proj_dim=32)), 2) is None
    assert model_refusal(FalconForCausalLM(FalconConfig(**sizes)), 1) is None


def test_a_plan_only_in_styles_this_split_does_not_run_is_refused_naming_them():
    class Fused(nn.Module):
        tp_plan = {"experts": "packed_colwise"}

        def __init__(self):
            super().__init__()
            self.experts = nn.Linear(4, 4)

    with pytest.raises(ValueError) as refused:
        resolve_plan(Fused(), None, 2)
    assert str(refused.value).startswith(
        "strategy.tensor_parallel_size=2: Fused.tp_plan splits its layers in styles this tensor parallelism does not"
        " run (packed_colwise: it splits layers colwise, rowwise, colwise_gather_output, rowwise_split_input); set"
        " strategy.tensor_parallel_plan")


def test_gpt_oss_s_attention_sinks_one_per_head_refuse_every_split_of_its_heads_in_one_line():
    """GPT-OSS's attention holds a sink per head beside its projections: a split of the heads left them whole, and
    every rank stopped in its first step in transformers' attention ("Sizes of tensors must match"), under fsdp_tp
    with a plan of the user's and under DeepSpeed AutoTP. Its own plan splits only the embedding, which stays whole."""
    model = GptOssForCausalLM(GptOssConfig(**SIZES, head_dim=8, num_local_experts=4))
    sinks = "model.layers.0.self_attn.sinks holds one value per attention head"
    with pytest.raises(ValueError, match=rf"^strategy.tensor_parallel_size=2: {sinks}, which a split of the heads would"
                       r" leave whole on every rank \(GPT-OSS's attention sinks\), and GptOssForCausalLM.tp_plan splits no"
                       " layer; train the model without tensor parallelism$"):
        resolve_plan(model, None, 2)
    attention = "model.layers.*.self_attn"
    plan = {f"{attention}.{name}": "colwise" for name in ("q_proj", "k_proj", "v_proj")} | {
        f"{attention}.o_proj": "rowwise"}
    with pytest.raises(ValueError, match=rf"^strategy.tensor_parallel_size=2: {sinks}, which a split of"
                       r" model.layers.0.self_attn.q_proj's heads leaves whole on every rank \(GPT-OSS's attention"
                       r" sinks\); train the model without tensor parallelism \(and 1 more layers\)$"):
        resolve_plan(model, plan, 2)
    assert model_refusal(model, 2) == (f"strategy.tensor_parallel_size=2: {sinks}, which DeepSpeed AutoTP's split"
                                       " of the heads leaves whole on every rank (GPT-OSS's attention sinks); train"
                                       " the model with strategy.tensor_parallel_size=1")
    assert model_refusal(LlamaForCausalLM(LlamaConfig(**SIZES)), 2) is None


def test_a_plan_that_splits_only_the_embedding_says_so():
    class Embedded(nn.Module):
        tp_plan = {"embed": "embedding_rowwise"}

        def __init__(self):
            super().__init__()
            self.embed, self.out = nn.Embedding(8, 4), nn.Linear(4, 4)

    with pytest.raises(ValueError, match=r"^strategy.tensor_parallel_size=2: Embedded.tp_plan splits only its embedding"
                       r" \(embedding_rowwise\), which stays whole here; set strategy.tensor_parallel_plan"):
        resolve_plan(Embedded(), None, 2)


def test_deepseek_s_rotary_key_is_summed_once_however_often_the_module_is_set_up():
    """Each set-up (fit, then fit again) finds the layers anew: a second hook would sum the gradient twice."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_dist.parallel.tensor_parallel import sum_rotary_key_gradients
    from tests.conftest import one_rank_world

    model = deepseek_v3()
    tokens = torch.randint(0, 64, (1, 8))
    expected = model(input_ids=tokens).logits
    with one_rank_world():
        mesh = init_device_mesh("cpu", (1,))
        for _ in range(2):
            sum_rotary_key_gradients(model, rotary_key_layers(model), mesh)
        layer = model.model.layers[0].self_attn.kv_a_proj_with_mqa
        assert len(layer._forward_hooks) == 1
        torch.testing.assert_close(model(input_ids=tokens).logits, expected, rtol=0, atol=0)
