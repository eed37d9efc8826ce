"""DeepSpeed's expert parallelism (AutoEP) as `strategy.expert_parallel_size` (strategies/deepspeed/autoep.py): a
transformers Mixtral (its load-balancing loss in `.loss`) trains under ZeRO-3 at ep 2 the losses of ep 1, tests
after fit as ddp does, and its checkpoints resume with the uninterrupted losses under the same size as they are and
under any other layout in the model's names; what AutoEP cannot take is one line before any rank starts."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from lightning_dist.reports.equivalence import read_train_losses
from lightning_dist.strategies.deepspeed.autoep import model_refusal
from tests.conftest import run_train

RUN = ("data.batch_size=2", "data.block_size=16", "trainer.devices=2", "trainer.max_steps=6",
       "trainer.log_every_n_steps=1", "trainer.limit_val_batches=0", "trainer.num_sanity_val_steps=0",
       "callbacks.model_checkpoint.monitor=null", "callbacks.model_checkpoint.every_n_train_steps=3",
       "callbacks.model_checkpoint.save_top_k=-1")
# Where a run tests after fit, 4 batches of the test split: at 16 tokens a window its whole split is 364 batches a rank,
# 70 s of each of the two shared runs (measured), and ep 2 against ep 1 is the same comparison on 4 of them.
TESTED = ("+trainer.limit_test_batches=4",)
ZERO_3 = ("model=hf_mixtral", "strategy=deepspeed_stage_3")


def tiny_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                            num_experts_per_tok=2, output_router_logits=True))


def test_autoep_takes_transformers_models_it_has_a_preset_for_and_refuses_the_rest():
    from lightning_dist.models.gpt_moe import GPTMoELanguageModel

    assert model_refusal(torch.nn.Sequential(tiny_mixtral()), 2, partitions_weights=True) is None
    assert model_refusal(torch.nn.Sequential(tiny_mixtral()), 8, partitions_weights=True) == (
        "strategy.expert_parallel_size=8: 0.model.layers.0.mlp.experts has 4 experts, which do not divide over 8"
        " ranks; choose a size that divides 4")
    said = model_refusal(GPTMoELanguageModel(block_size=16, n_layer=2), 2, partitions_weights=False)
    assert said.startswith("strategy.expert_parallel_size=2: DeepSpeed's expert parallelism (AutoEP) splits"
                           " transformers MoE models it has a preset for (mixtral, qwen3_moe, ")
    assert said.endswith("GPTMoELanguageModel holds none. FSDP's splits any layer that calls its experts as"
                         " experts(hidden_states, top_k_index, top_k_weights): strategy=fsdp")


def test_zero_3_refuses_frozen_experts_whose_saves_deepspeed_cannot_write():
    """A LoRA fine-tune's experts are frozen: DeepSpeed 0.19.8 trained it under ZeRO-3 with AutoEP, then stopped at the
    first save ("AutoEP with ZeRO Stage 3 checkpointing does not support frozen expert parameters yet")."""
    model = torch.nn.Sequential(tiny_mixtral())
    model[0].model.layers[1].mlp.experts.requires_grad_(False)
    assert model_refusal(model, 2, partitions_weights=False) is None  # ZeRO-1/2 keep them
    assert model_refusal(model, 2, partitions_weights=True) == (
        "strategy.expert_parallel_size=2: 0.model.layers.1.mlp.experts is frozen (a LoRA fine-tune's base), and"
        " DeepSpeed's ZeRO-3 checkpoints under AutoEP hold no frozen expert weights (its first save stops the run);"
        " split the experts under FSDP (strategy=fsdp strategy.expert_parallel_size=2), or train them")


def test_transformers_registry_reads_as_a_dict_for_autoep_only_while_inside():
    from transformers.utils import output_capturing

    from lightning_dist._compat.deepspeed import autoep_reads_transformers_outputs

    model, registry = tiny_mixtral(), output_capturing._CAN_RECORD_REGISTRY
    own = registry.get(model)
    assert own  # Mixtral records its router logits
    with autoep_reads_transformers_outputs():
        assert registry.get("no such model", "default") == "default"  # what AutoEP 0.19.8 calls
        assert registry.get(model) == own
    with pytest.raises(TypeError):
        registry.get("no such model", "default")


def test_a_model_whose_hooks_were_removed_records_its_router_logits_again():
    """Lightning removes every module hook before DeepSpeed's engine for a test after fit; Mixtral's load-balancing
    loss then had no router logits to read (IndexError)."""
    from lightning_dist._compat.lightning import remove_module_hooks
    from lightning_dist._compat.transformers import recapture_outputs_after_hooks_removed

    model, tokens = tiny_mixtral(), torch.randint(0, 64, (2, 8))
    before = model(input_ids=tokens, labels=tokens).loss
    remove_module_hooks(model)
    with pytest.raises(IndexError):
        model(input_ids=tokens, labels=tokens)
    recapture_outputs_after_hooks_removed(model)
    assert model(input_ids=tokens, labels=tokens).loss.item() == pytest.approx(before.item(), abs=1e-6)


@pytest.fixture(scope="module")
def zero_3_runs(tmp_path_factory, deepspeed_ops):
    runs = {}
    for ep in (1, 2):
        runs[ep] = run_train(tmp_path_factory.mktemp(f"ep{ep}"), *RUN, *ZERO_3, *TESTED,
                             f"strategy.expert_parallel_size={ep}")
        assert runs[ep].process.returncode == 0, runs[ep].output[-3000:]
    return runs


@pytest.mark.slow
def test_zero_3_at_ep_2_trains_and_tests_ep_1_s_losses(zero_3_runs):
    ours, theirs = (read_train_losses(zero_3_runs[ep].run_dir) for ep in (2, 1))
    assert sorted(ours) == list(range(6))
    assert ours == pytest.approx(theirs, abs=1e-5)
    test_losses = [zero_3_runs[ep].output.split("test_loss=")[1].split(",")[0] for ep in (1, 2)]
    assert test_losses[0] == test_losses[1]


@pytest.mark.slow
def test_an_ep_2_checkpoint_resumes_under_ep_2_and_in_the_model_s_names_anywhere_and_back(zero_3_runs, tmp_path):
    """AutoEP's layers name the router and experts their own way (router.gate, experts.w1/w2/w3, each rank its share
    of the experts): under the same size DeepSpeed reads the checkpoint as it is; ddp and ZeRO-3 without AutoEP read it
    consolidated in the model's names, and AutoEP reads a file in the model's names back into its own. Each continues
    the uninterrupted losses, Adam's moments included (without them step 4 differs)."""
    checkpoint = zero_3_runs[2].run_dir / "checkpoints" / "step000003.ckpt"
    uninterrupted = read_train_losses(zero_3_runs[2].run_dir)

    def continues_the_uninterrupted_run(run) -> None:
        assert run.process.returncode == 0, run.output[-3000:]
        ours = read_train_losses(run.run_dir)
        assert sorted(ours) == [3, 4, 5]
        assert ours == pytest.approx({step: uninterrupted[step] for step in ours}, abs=1e-6)

    resumed = run_train(tmp_path / "resumed", *RUN, *ZERO_3, "strategy.expert_parallel_size=2", "test=false",
                        f"ckpt_path={checkpoint}")
    continues_the_uninterrupted_run(resumed)
    last = resumed.run_dir / "checkpoints" / "last.ckpt"
    assert f"Last checkpoint: {last} (shards; one file: lightning-dist consolidate {last} model.ckpt)" in resumed.output
    continues_the_uninterrupted_run(run_train(tmp_path / "ddp", *RUN, "model=hf_mixtral", "strategy=ddp", "test=false",
                                              f"ckpt_path={checkpoint}"))
    continues_the_uninterrupted_run(run_train(tmp_path / "zero_3", *RUN, *ZERO_3, "test=false",
                                              f"ckpt_path={checkpoint}"))
    one_file = subprocess.run([sys.executable, "-m", "lightning_dist.commands", "consolidate", str(checkpoint),
                               str(tmp_path / "model.ckpt")], capture_output=True, text=True, timeout=300)
    assert one_file.returncode == 0, one_file.stderr[-3000:]
    saved = torch.load(tmp_path / "model.ckpt", map_location="cpu", weights_only=True)
    experts = "model.model.layers.0.mlp.experts"
    assert {name: tuple(saved["state_dict"][name].shape) for name in (f"{experts}.gate_up_proj", f"{experts}.down_proj")} \
        == {f"{experts}.gate_up_proj": (8, 512, 128), f"{experts}.down_proj": (8, 128, 256)}  # all 8 experts, fused
    # The model's names back into AutoEP's, each rank its own experts.
    continues_the_uninterrupted_run(run_train(tmp_path / "from_one_file", *RUN, *ZERO_3, "test=false",
                                              "strategy.expert_parallel_size=2", f"ckpt_path={tmp_path / 'model.ckpt'}"))


@pytest.mark.slow
def test_what_autoep_cannot_take_is_one_line_before_any_rank_starts(tmp_path):
    """As typed: ZeRO-2 with the module's optimizer (DeepSpeed asks for parameter groups it cannot have), the
    bundled MoE (no transformers model AutoEP has a preset for)."""
    zero_2 = run_train(tmp_path / "zero_2", *RUN, "model=hf_mixtral", "strategy=deepspeed_stage_2",
                       "strategy.expert_parallel_size=2")
    assert zero_2.process.returncode == 2
    assert zero_2.process.stderr.strip().splitlines() == [
        "error: strategy: 1 problem: strategy.expert_parallel_size=2: DeepSpeed's ZeRO-2 steps AutoEP's experts only in"
        " parameter groups of their own, which the optimizer of configure_optimizers, built before AutoEP makes the"
        " experts, cannot have; use ZeRO-3 (strategy=deepspeed_stage_3), or an optimizer block in the DeepSpeed"
        " config (strategy.config), from which DeepSpeed builds them"]
    bundled = run_train(tmp_path / "gpt_moe", *RUN, "model=gpt_moe", "strategy=deepspeed_stage_3",
                        "strategy.expert_parallel_size=2")
    assert bundled.process.returncode == 2
    assert bundled.process.stderr.strip().splitlines()[-1].startswith(
        "error: strategy.expert_parallel_size=2: DeepSpeed's expert parallelism (AutoEP) splits transformers MoE"
        " models it has a preset for")
    assert not (tmp_path / "zero_2" / "checkpoints").exists()
