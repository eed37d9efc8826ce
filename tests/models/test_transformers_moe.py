"""transformers' own mixture-of-experts models beside Mixtral (tests/models/test_finetune_runs.py,
tests/parallel/test_expert_parallel.py): Qwen2-MoE (with its shared expert) and OLMoE, config-built from
`model=hf_mixtral`'s group as users override it, train under every engine with ddp's per-step losses, their routers'
balancing loss in the step's, and under the axes with one rank's (OLMoE's tensor-parallel plan gathers its attention's
projections: tests/parallel/test_transformers_plans.py). What cannot run is refused in one line: OLMoE has no
pipeline plan.
"""

from __future__ import annotations

import pytest
from transformers import (
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from lightning_dist.parallel.tensor_parallel import resolve_plan
from lightning_dist.reports.equivalence import read_train_losses
from tests.conftest import in_the_suite, run_train

MODELS = {
    "qwen2_moe": ("model=hf_mixtral", "model.model_type=qwen2_moe", "~model.config.num_local_experts",
                  "+model.config.num_experts=8", "+model.config.moe_intermediate_size=64",
                  "+model.config.shared_expert_intermediate_size=128", "+model.config.decoder_sparse_step=1"),
    "olmoe": ("model=hf_mixtral", "model.model_type=olmoe", "~model.config.num_local_experts",
              "+model.config.num_experts=8"),
}
RUN = ("data.batch_size=2", "data.block_size=32", "trainer.max_steps=4", "trainer.log_every_n_steps=1",
       "trainer.limit_val_batches=0", "test=false")
ENGINES = [(model, engine) for model in MODELS
           for engine in ("fsdp_activation_checkpointing", "deepspeed_stage_2", "deepspeed_stage_3_offload")]
# The axes split one batch over 2 ranks: one rank's losses. The balancing loss is over each forward's tokens (a
# microbatch, a shard), so pipeline and context parallelism are compared with it off, as for model=gpt_moe.
AXES = {"fsdp_tp": ("strategy=fsdp_tp",), "fsdp_pp": ("strategy=fsdp_pp",),
        "cp 2": ("strategy=fsdp", "strategy.context_parallel_size=2")}
AXIS_CASES = [("qwen2_moe", "fsdp_tp"), ("qwen2_moe", "fsdp_pp"), ("qwen2_moe", "cp 2"), ("olmoe", "fsdp_tp"),
              ("olmoe", "cp 2")]


@pytest.mark.parametrize("model_type", ["glm4_moe", "deepseek_v3"])
def test_a_model_without_a_balancing_loss_asked_for_one_is_refused_in_one_line(model_type):
    """`model=hf_mixtral` asks for the routers' balancing loss; GLM-4-MoE and DeepSeek-V3 take the key and never
    compute one, and every rank stopped in its first step blaming pipeline stages it did not have."""
    from lightning_dist.models.hf_language_model import HFLanguageModel

    config = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, n_routed_experts=4, moe_intermediate_size=16, first_k_dense_replace=1,
                  n_group=1, topk_group=1, num_experts_per_tok=2, output_router_logits=True)
    name = {"glm4_moe": "Glm4MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}[model_type]
    with pytest.raises(ValueError, match=rf"^model.config.output_router_logits=true: {name} computes no routers'"
                       r" load-balancing loss \(transformers has none for it\); set"
                       " model.config.output_router_logits=false$"):
        HFLanguageModel(model_type=model_type, config=config)
    HFLanguageModel(model_type=model_type, config={**config, "output_router_logits": False})
    HFLanguageModel(model_type="olmoe", config={**config, "num_experts": 4})  # OLMoE computes one


def test_a_model_s_own_plan_leaves_out_the_dense_layers_its_config_did_not_build():
    """Qwen2-MoE's plan names the dense MLP of its `mlp_only_layers`; with experts in every layer there is none, and
    its fsdp_tp run was refused ("names no module"). A plan the user wrote is still held to every pattern."""
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                               moe_intermediate_size=16, shared_expert_intermediate_size=32))
    assert resolve_plan(model, None, 2) == {f"model.layers.*.self_attn.{name}": style for name, style in
                                            (("q_proj", "colwise"), ("k_proj", "colwise"), ("v_proj", "colwise"),
                                             ("o_proj", "rowwise"))}
    with pytest.raises(ValueError, match=r"^strategy.tensor_parallel_plan: model.layers.\*.mlp.up_proj names no module"):
        resolve_plan(model, {"model.layers.*.self_attn.o_proj": "rowwise", "model.layers.*.mlp.up_proj": "colwise"}, 2)


def test_a_model_s_plan_sums_its_per_head_norms_gradients_and_a_plan_that_splits_their_heads_must_too():
    """Qwen3's q and k norms act on each head (head_dim wide): with the heads split, each rank's norm weights get the
    gradient of its own heads only, and its plan asks for them to be summed over the ranks (torch's SequenceParallel
    over the heads; tests/strategies/test_tensor_parallel.py trains it). A plan the user writes that splits those heads
    and leaves the norms out is refused in one line naming what to add: measured before the sum, Qwen3 under fsdp_tp
    drifted from one rank's losses (5.518371 against 5.518313 at step 1), silently."""
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                               moe_intermediate_size=16, head_dim=8))
    attention = "model.layers.*.self_attn"
    assert resolve_plan(model, None, 2) == {f"{attention}.{name}": style for name, style in (
        ("q_proj", "colwise"), ("k_proj", "colwise"), ("v_proj", "colwise"),
        ("q_norm", "replicated_with_grad_allreduce"), ("k_norm", "replicated_with_grad_allreduce"),
        ("o_proj", "rowwise"))}
    written = {f"{attention}.q_proj": "colwise", f"{attention}.k_proj": "colwise", f"{attention}.o_proj": "rowwise"}
    with pytest.raises(ValueError) as refused:
        resolve_plan(model, written, 2)
    assert str(refused.value) == (
        f"strategy.tensor_parallel_plan: {attention}.q_proj splits the heads of {attention}.q_norm and"
        f" {attention}.k_norm, which Qwen3MoeForCausalLM.tp_plan keeps whole on every rank with their gradients summed"
        " over the tensor-parallel ranks (each rank's gradient is its own heads' part); add"
        f" '{attention}.q_norm': replicated_with_grad_allreduce, '{attention}.k_norm': replicated_with_grad_allreduce"
        " to the plan, or leave the attention whole")
    completed = {**written, f"{attention}.q_norm": "replicated_with_grad_allreduce",
                 f"{attention}.k_norm": "replicated_with_grad_allreduce"}
    assert resolve_plan(model, completed, 2) == completed
    dense = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    whole_attention = {"model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"}
    assert resolve_plan(dense, whole_attention, 2) == whole_attention


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """ddp's losses, made on first use: {(model, ranks, balancing loss on): {step: loss}}."""

    class References(dict):
        def __missing__(self, key):
            model, ranks, balance = key
            run = run_train(tmp_path_factory.mktemp(f"{model}_ddp"), *MODELS[model], *RUN, "strategy=ddp",
                            f"trainer.devices={ranks}", f"model.config.output_router_logits={balance}")
            assert run.process.returncode == 0, run.output[-3000:]
            self[key] = read_train_losses(run.run_dir)
            return self[key]

    return References()


def assert_same_losses(ours: dict, reference: dict) -> None:
    assert sorted(ours) == sorted(reference) == list(range(4))
    for step, loss in reference.items():
        assert ours[step] == pytest.approx(loss, rel=1e-5), (step, ours[step], loss)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "engine"), in_the_suite(ENGINES, [("qwen2_moe", "deepspeed_stage_2")], unpack=True))
def test_each_engine_trains_ddp_s_losses_with_the_balancing_loss(model, engine, references, tmp_path, deepspeed_ops):
    """Fused experts give every expert a gradient on every rank: ZeRO-1/2, refused for model=gpt_moe's experts as
    modules, train these (measured: equal to ddp's to the 6th decimal under each engine)."""
    run = run_train(tmp_path, *MODELS[model], *RUN, f"strategy={engine}", "trainer.devices=2")
    assert run.process.returncode == 0, run.output[-3000:]
    assert_same_losses(read_train_losses(run.run_dir), references[model, 2, "true"])


@pytest.mark.slow
@pytest.mark.parametrize(("model", "axis"), in_the_suite(AXIS_CASES, [("olmoe", "fsdp_tp")], unpack=True))
def test_the_axes_train_one_rank_s_losses(model, axis, references, tmp_path):
    run = run_train(tmp_path, *MODELS[model], *RUN, *AXES[axis], "trainer.devices=2",
                    "model.config.output_router_logits=false")
    assert run.process.returncode == 0, run.output[-3000:]
    assert_same_losses(read_train_losses(run.run_dir), references[model, 1, "false"])
