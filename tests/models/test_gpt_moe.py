"""`model=gpt_moe`, the bundled mixture-of-experts GPT (lightning_dist/models/gpt_moe.py), with experts as modules of
their own that are called only when a token chose them: the layout that hangs ZeRO-3 (DeepSpeed #4808), that DDP
refuses without `find_unused_parameters`, and that makes FSDP2's gradient collectives differ between ranks. Every
engine trains it with ddp's per-step losses on batches where some experts get no tokens on some ranks
(lightning_dist/parallel/experts.py gives every expert a gradient on every rank; ZeRO-3 makes its layers leaves).
ZeRO-1 and -2, which sum gradients in the order they arrive, are refused in one line (their runs were 1.5e-3 from
ddp's from step 1 on, silently)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from lightning_dist.models.gpt_moe import GPTMoELanguageModel, MixtureOfExperts
from lightning_dist.parallel.experts import every_expert_in_backward, expert_layers
from lightning_dist.reports.equivalence import read_train_losses
from lightning_dist.reports.flops import matmul_parameters
from tests.conftest import in_the_suite, run_train


def language_model_loss(model: GPTMoELanguageModel, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())


def test_the_balance_loss_trains_as_if_added_to_the_loss():
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (2, 32))
    weighed = GPTMoELanguageModel(block_size=32, balance=0.5)
    added = GPTMoELanguageModel(block_size=32, balance=0.0)
    added.load_state_dict(weighed.state_dict())
    language_model_loss(weighed, tokens).backward()
    loss = language_model_loss(added, tokens)
    layers = [layer for layer in added.modules() if isinstance(layer, MixtureOfExperts)]
    (loss + 0.5 * sum(layer.balance_loss for layer in layers)).backward()
    for (name, a), b in zip(weighed.named_parameters(), added.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)


def one_expert_layer() -> MixtureOfExperts:
    """A layer whose router sends every token of positive inputs to expert 0."""
    layer = MixtureOfExperts(d_model=8, n_experts=4, top_k=1, shared_expert=False, balance=0.01)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0] = 1.0
    return layer


def test_an_expert_no_token_chose_is_not_called_and_once_hooked_gets_a_zero_gradient():
    inputs = torch.rand(2, 3, 8) + 0.1
    plain, hooked = one_expert_layer(), one_expert_layer()
    hooked.load_state_dict(plain.state_dict())
    assert every_expert_in_backward(hooked) == [""] and every_expert_in_backward(hooked) == [""]  # hooked once
    for layer in (plain, hooked):
        layer(inputs).square().sum().backward()
        assert layer.tokens_per_expert.tolist() == [6, 0, 0, 0]
    assert all(p.grad is None for expert in plain.experts[1:] for p in expert.parameters())
    assert all(p.grad is not None and not p.grad.any() for expert in hooked.experts[1:] for p in expert.parameters())
    for a, b in zip(plain.experts[0].parameters(), hooked.experts[0].parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_mfu_counts_the_experts_a_token_goes_through():
    from transformers import MixtralConfig, MixtralForCausalLM

    gpt = GPTMoELanguageModel(block_size=32)  # d 128, 4 blocks, 8 experts, top 2
    assert [name for name, _ in expert_layers(gpt)] == [f"model.blocks.{i}.moe" for i in range(4)]
    attention, router, expert, tied = 4 * 128 * 128, 8 * 128, 2 * 128 * 512, 256 * 128
    assert matmul_parameters(gpt) == 4 * (attention + router + 8 * expert * 2 / 8) + tied
    config = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
    mixtral = MixtralForCausalLM(config)  # fused experts: 3-D parameters, the experts first
    attention, router, experts, head = 64 * 64 * 2 + 64 * 32 * 2, 8 * 64, 8 * 3 * 64 * 128, 256 * 64
    assert matmul_parameters(mixtral) == 2 * (attention + router + experts * 2 / 8) + head


def test_a_transformers_moe_step_adds_its_routers_balancing_loss_as_the_model_does_with_labels():
    from lightning_dist.models.hf_language_model import HFLanguageModel

    config = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True)
    module = HFLanguageModel("mixtral", config)  # model=hf_mixtral's
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    inputs, targets = ids[:, :-1], ids[:, 1:].clone()
    targets[:, -1] = -100  # the prediction `labels=` cannot ask for (the model shifts them itself): ignored
    with torch.no_grad():
        ours = module.training_step((inputs, targets), 0)
        theirs = module.model(input_ids=inputs, labels=inputs)
    assert theirs.aux_loss > 0 and ours.item() == pytest.approx(theirs.loss.item(), rel=1e-6)


def test_transformers_routers_count_their_tokens_per_expert_for_the_monitor():
    from transformers import MixtralConfig, MixtralForCausalLM

    from lightning_dist.parallel.experts import count_routed_tokens

    config = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    mixtral = MixtralForCausalLM(config)
    assert count_routed_tokens(mixtral) == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        routed = mixtral(input_ids=ids, output_router_logits=True).router_logits  # each layer's (tokens, experts)
    for layer, logits in zip(mixtral.model.layers, routed, strict=True):
        chosen = logits.topk(2, dim=-1).indices
        assert layer.mlp.gate.tokens_per_expert.tolist() == torch.bincount(chosen.flatten(), minlength=4).tolist()
        assert layer.mlp.gate.tokens_per_expert.sum() == 32 * 2

    class OtherRouter(torch.nn.Linear):  # a router of the user's own: left alone
        num_experts = 4

    assert count_routed_tokens(torch.nn.Sequential(OtherRouter(8, 4))) == []
    # One of transformers' that returned its logits only (its API changed): its count cannot be taken.
    OtherRouter.__module__ = "transformers.models.other.modeling_other"
    model = torch.nn.Sequential(OtherRouter(8, 4))
    assert count_routed_tokens(model) == ["0"]
    with pytest.raises(RuntimeError, match=r"^OtherRouter returned no experts' indices last \(transformers' routers"):
        model(torch.ones(2, 8))


# 16 tokens a rank, each to 1 of 8 experts: in most steps some expert of some layer gets none on some rank.
MOE_RUN = ("model=gpt_moe", "data.batch_size=1", "data.block_size=16", "model.top_k=1", "trainer.devices=2",
           "trainer.max_steps=6", "trainer.log_every_n_steps=1", "trainer.limit_val_batches=0", "test=false",
           "+callbacks.idle_experts._target_=tests.probes.IdleExperts",
           "+callbacks.idle_experts.directory=${paths.output_dir}")
ENGINES = ["fsdp", "fsdp_activation_checkpointing", "deepspeed_stage_3", "deepspeed_stage_3_offload"]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    run = run_train(tmp_path_factory.mktemp("moe_ddp"), "strategy=ddp", *MOE_RUN)
    assert run.process.returncode == 0, run.output[-3000:]
    return run


@pytest.mark.slow
def test_ddp_trains_it_with_experts_idle_on_one_rank_and_called_on_the_other(ddp_run):
    idle = [{(step, layer, expert) for step, layer, expert in json.loads(path.read_text())}
            for path in sorted(ddp_run.run_dir.glob("idle_experts_rank*.json"))]
    assert len(idle) == 2
    assert idle[0] - idle[1] and idle[1] - idle[0]  # an expert skipped on one rank, called on the other, both ways
    assert sorted(read_train_losses(ddp_run.run_dir)) == list(range(6))


@pytest.mark.slow
@pytest.mark.parametrize("name", in_the_suite(ENGINES, ["fsdp_activation_checkpointing", "deepspeed_stage_3"]))
def test_each_engine_trains_ddp_s_losses(name, ddp_run, tmp_path, deepspeed_ops):
    run = run_train(tmp_path, f"strategy={name}", *MOE_RUN)
    assert run.process.returncode == 0, run.output[-3000:]
    ours, reference = read_train_losses(run.run_dir), read_train_losses(ddp_run.run_dir)
    assert sorted(ours) == sorted(reference) == list(range(6))
    for step, loss in reference.items():
        assert ours[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), (step, ours[step], loss)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_1_and_2_are_refused_in_one_line_before_any_rank_starts(stage, tmp_path):
    run = run_train(tmp_path, f"strategy=deepspeed_stage_{stage}", *MOE_RUN)
    assert run.process.returncode == 2, run.output[-3000:]
    assert run.process.stderr.strip().splitlines()[-1] == (
        f"error: ZeRO stage {stage}: model.blocks.0.moe calls only the experts its tokens chose, so the ranks'"
        f" gradients reach ZeRO-{stage}'s buckets in different orders and would be summed with each other's; use"
        " ZeRO-3 (strategy=deepspeed_stage_3, which orders its buckets) or fsdp")
    assert "Initializing distributed" not in run.output and not list(tmp_path.rglob("*.ckpt"))


# Tensor, pipeline and context parallelism on 2 ranks against ddp on 1, the same batch. The balancing loss is over the
# tokens of each forward: a pipeline's microbatch, a context-parallel shard (as under gradient accumulation), so
# those two train ddp's losses with it off; tensor parallelism routes the whole batch on each rank, and keeps it on.
SPLIT_RUN = ("model=gpt_moe", "data.batch_size=2", "data.block_size=32", "trainer.max_steps=6",
             "trainer.log_every_n_steps=1", "trainer.limit_val_batches=0", "test=false")
AXES = {"fsdp_tp": ("strategy=fsdp_tp",), "fsdp_pp": ("strategy=fsdp_pp", "model.balance=0"),
        "fsdp cp 2": ("strategy=fsdp", "strategy.context_parallel_size=2", "model.balance=0")}


@pytest.fixture(scope="module")
def one_rank_runs(tmp_path_factory):
    runs = {}
    for balance in ("model.balance=0.01", "model.balance=0"):
        run = run_train(tmp_path_factory.mktemp("moe_one_rank"), "strategy=ddp", "trainer.devices=1", *SPLIT_RUN,
                        balance)
        assert run.process.returncode == 0, run.output[-3000:]
        runs[balance] = read_train_losses(run.run_dir)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("axis", list(AXES))
def test_tensor_pipeline_and_context_parallelism_train_one_rank_s_losses(axis, one_rank_runs, tmp_path):
    overrides = AXES[axis]
    run = run_train(tmp_path, "trainer.devices=2", *SPLIT_RUN, *overrides)
    assert run.process.returncode == 0, run.output[-3000:]
    reference = one_rank_runs["model.balance=0" if "model.balance=0" in overrides else "model.balance=0.01"]
    ours = read_train_losses(run.run_dir)
    assert sorted(ours) == sorted(reference) == list(range(6))
    for step, loss in reference.items():
        assert ours[step] == pytest.approx(loss, rel=1e-5), (step, ours[step], loss)
