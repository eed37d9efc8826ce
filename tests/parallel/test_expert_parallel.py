"""Expert parallelism (lightning_dist/parallel/expert_parallel): each rank of a group holds experts / size of each
layer, tokens go to their experts and back by all-to-all. Its layout over the ranks, its refusals, the dispatch on
two gloo ranks against the unsplit experts, and runs of train.py as users type them: ep 2 x dp 2 trains ep 1's
losses for the bundled MoE and a transformers Mixtral LoRA fine-tune, adapters on its experts too (with activation
checkpointing), beside tensor and context parallelism too, and its checkpoints resume under ep 1, 4, ddp and ZeRO-3 (and ep 1's under ep 2) with the
uninterrupted run's losses."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from lightning_dist.models.gpt import GPTLanguageModel
from lightning_dist.models.gpt_moe import GPTMoELanguageModel
from lightning_dist.parallel.dims import ParallelDims
from lightning_dist.parallel.expert_parallel import experts_modules, refusal
from lightning_dist.parallel.sizes import ParallelSizes
from lightning_dist.reports.equivalence import read_train_losses
from tests.conftest import REPO, in_the_suite, run_train


@pytest.mark.parametrize(("sizes", "expert_ranks"), [
    (ParallelSizes(expert=2), [0, 1, 0, 1]),  # the experts' shard ranks outer: {0, 2} and {1, 3} hold the same
    (ParallelSizes(expert=4), [0, 1, 2, 3]),
    (ParallelSizes(expert=2, context=2), [0, 1, 0, 1]),  # a context-parallel group is one expert-parallel group
    (ParallelSizes(expert=2, tensor=2), [0, 0, 1, 1]),  # a tensor-parallel group routes as one rank
])
def test_the_expert_parallel_ranks_are_taken_from_those_fsdp_shards_over(sizes, expert_ranks):
    dims = sizes.check(devices=4, num_nodes=1)
    assert dims.ep == sizes.expert and dims.world_size == 4
    assert [dims.expert_rank(rank) for rank in range(4)] == expert_ranks


@pytest.mark.parametrize(("sizes", "devices", "line"), [
    (ParallelSizes(expert=3), 4, "strategy.expert_parallel_size=3: expert parallelism splits the experts over ranks"
     " among the 4 that FSDP shards each parameter over; choose a size that divides 4"),
    (ParallelSizes(expert=4, tensor=2), 4, "strategy.expert_parallel_size=4: expert parallelism splits the experts"
     " over ranks among the 2 that FSDP shards each parameter over; choose a size that divides 2"),
    (ParallelSizes(expert=2, context=4), 8, "strategy.expert_parallel_size=2: an expert-parallel group takes in"
     " whole context-parallel groups (strategy.context_parallel_size=4); choose a multiple of 4"),
    (ParallelSizes(expert=2, pipeline=2), 4, "strategy.expert_parallel_size=2: expert parallelism does not run"
     " beside strategy.pipeline_parallel_size=2 yet"),
    (ParallelSizes(expert=2, hybrid=True), 4, "strategy.expert_parallel_size=2: expert parallelism does not run"
     " beside strategy.sharding_strategy=HYBRID_SHARD yet"),
])
def test_sizes_expert_parallelism_cannot_take_are_one_line_naming_the_key(sizes, devices, line):
    with pytest.raises(ValueError) as refused:
        sizes.check(devices=devices, num_nodes=1)
    assert str(refused.value) == line


def test_parallel_dims_refuse_an_expert_size_that_does_not_split_its_ranks():
    with pytest.raises(ValueError, match=r"^ParallelDims.ep=2: expert parallelism takes each context-parallel group"):
        ParallelDims(dp_shard=2, cp=4, ep=2)
    assert ParallelDims.resolve(8, ep=4).dp_shard == 8  # ep does not multiply into the world


class LoopsItsExperts(nn.Module):
    """A DeepSeek-style layer: a list of experts it calls one by one itself."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))


def test_models_whose_experts_cannot_be_split_are_refused_in_one_line():
    moe = GPTMoELanguageModel(block_size=16, n_layer=2, n_experts=6)
    assert [name for name, _ in experts_modules(moe)] == ["model.blocks.0.moe.experts", "model.blocks.1.moe.experts"]
    assert refusal(moe, 2) is None and refusal(moe, 3) is None
    assert refusal(moe, 4) == ("strategy.expert_parallel_size=4: model.blocks.0.moe.experts has 6 experts, which do"
                               " not divide over 4 ranks; choose a size that divides 6")
    assert refusal(GPTLanguageModel(block_size=16), 2) == (
        "strategy.expert_parallel_size=2: GPTLanguageModel has no experts to split (no module called as"
        " experts(hidden_states, top_k_index, top_k_weights), as transformers' MoE models and model=gpt_moe have);"
        " set it to 1")
    assert refusal(nn.Sequential(LoopsItsExperts()), 2) == (
        "strategy.expert_parallel_size=2: 0 calls its experts one by one itself; expert parallelism splits the"
        " experts where a layer calls them as experts(hidden_states, top_k_index, top_k_weights) (transformers' MoE"
        " models, model=gpt_moe)")


def test_transformers_fused_experts_are_found_and_their_routers_are_not():
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2)
    assert [name for name, _ in experts_modules(MixtralForCausalLM(config))] == [
        "model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


def test_lora_on_the_experts_parameters_is_found_around_the_experts_it_adapts():
    """PEFT's all-linear adds a mixture of experts' 3-D parameters to LoRA's targets (target_parameters), wrapping the
    experts module once per parameter: the module split is the innermost, and the wrappers' adapters are found to go
    with it (the experts split without them, every rank had stopped in the first step: `aten.baddbmm.default got
    mixed torch.Tensor and DTensor`)."""
    from peft import LoraConfig, get_peft_model
    from transformers import MixtralConfig, MixtralForCausalLM

    from lightning_dist._compat.peft import parameter_adapters

    config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2)
    adapted = get_peft_model(MixtralForCausalLM(config), LoraConfig(r=4, target_modules="all-linear"))
    assert refusal(adapted, 2) is None
    names = [name for name, _ in experts_modules(adapted)]
    assert names == [f"base_model.model.model.layers.{layer}.mlp.experts.base_layer.base_layer" for layer in (0, 1)]
    assert [wrapper.parameter_name for wrapper in parameter_adapters(adapted, names[0])] == ["down_proj",
                                                                                          "gate_up_proj"]
    attention = get_peft_model(MixtralForCausalLM(config), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert parameter_adapters(attention, "base_model.model.model.layers.0.mlp.experts") == []


@pytest.mark.compat  # DTensor slices, functional all-to-alls, parametrized PEFT factors: on every torch we support
def test_two_ranks_split_the_experts_with_the_unsplit_outputs_and_gradients(tmp_path):
    """The layouts (a list of modules, transformers' fused 3-D parameters, Mixtral's and GPT-OSS's, these with LoRA
    on their weights); an expert no token chose anywhere, one chosen by one rank's tokens only."""
    run = subprocess.run([sys.executable, "-m", "tests.parallel.expert_dispatch_ranks", str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        held = [f"{expert}.{layer}.{kind}" for expert in (2 * rank, 2 * rank + 1) for layer in (0, 2)
                for kind in ("bias", "weight")]
        assert results["module_list"].pop("held") == held  # this rank's experts, by their own names
        assert results["fused"].pop("held") == results["fused_lora"].pop("held") == ["down_proj", "gate_up_proj"]
        assert results["gpt_oss"].pop("held") == results["gpt_oss_lora"].pop("held") == [
            "down_proj", "down_proj_bias", "gate_up_proj", "gate_up_proj_bias"]
        for kind, differences in results.items():
            # outputs, hidden states' and routing weights' gradients; each trained parameter's (LoRA's 4 factors);
            # LoRA's: the outputs with its adapters disabled too
            assert len(differences) == {"module_list": 3 + 8, "fused": 3 + 2, "fused_lora": 3 + 4 + 1, "gpt_oss": 3 + 4,
                                        "gpt_oss_lora": 3 + 4 + 1}[kind]
            assert max(differences.values()) < 1e-6, (rank, kind, differences)


# 4 ranks, ep 2 x dp 2; 32 tokens a rank, each to 2 of 8 experts: an expert often gets none on some rank. (With 1
# expert a token the routing weight is p / p: the router's gradient is rounding noise, which Adam makes steps of.)
STEPS, SAVED_AT = 6, 3
EP_RUN = ("data.batch_size=2", "data.block_size=16", "trainer.devices=4", f"trainer.max_steps={STEPS}",
          "trainer.log_every_n_steps=1", "trainer.limit_val_batches=0", "test=false",
          f"callbacks.model_checkpoint.every_n_train_steps={SAVED_AT}", "callbacks.model_checkpoint.save_top_k=-1",
          "callbacks.model_checkpoint.monitor=null")
MODELS = {"gpt_moe": ("model=gpt_moe", "model.n_layer=2"), "hf_mixtral": ("model=hf_mixtral",
                                                                           "model.config.num_hidden_layers=2"),
          # 1 expert a rank and 2 ranks left to shard it: FSDP cuts the fused experts on their second dimension.
          "hf_mixtral 2 experts": ("model=hf_mixtral", "model.config.num_hidden_layers=2",
                                   "model.config.num_local_experts=2"),
          # LoRA as users fine-tune a mixture of experts: all-linear puts adapters on the fused experts' parameters
          "hf_mixtral lora": ("model=hf_mixtral", "model.config.num_hidden_layers=2", "+lora=default")}
RUNS = {
    "gpt_moe ep 1": ("strategy=fsdp", *MODELS["gpt_moe"]),
    "gpt_moe ep 2": ("strategy=fsdp", "strategy.expert_parallel_size=2", *MODELS["gpt_moe"]),  # the docs' command
    "hf_mixtral ep 1": ("strategy=fsdp", *MODELS["hf_mixtral"]),
    "hf_mixtral ep 2": ("strategy=fsdp_activation_checkpointing", "strategy.expert_parallel_size=2",
                        *MODELS["hf_mixtral"]),
    "hf_mixtral 2 experts ep 1": ("strategy=fsdp", *MODELS["hf_mixtral 2 experts"]),
    "hf_mixtral 2 experts ep 2": ("strategy=fsdp", "strategy.expert_parallel_size=2", *MODELS["hf_mixtral 2 experts"]),
    "hf_mixtral lora ep 1": ("strategy=fsdp", *MODELS["hf_mixtral lora"]),
    "hf_mixtral lora ep 2": ("strategy=fsdp_activation_checkpointing", "strategy.expert_parallel_size=2",
                             *MODELS["hf_mixtral lora"]),
}


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory):
    """Each of RUNS once, when a test first asks for it."""
    done = {}

    def run(name: str):
        if name not in done:
            done[name] = run_train(tmp_path_factory.mktemp(name.replace(" ", "_")), *RUNS[name], *EP_RUN)
            assert done[name].process.returncode == 0, done[name].output[-3000:]
        return done[name]

    return run


def assert_same_losses(ours: dict[int, float], reference: dict[int, float], steps: range = range(STEPS)) -> None:
    assert sorted(ours) == list(steps)
    for step in steps:
        assert ours[step] == pytest.approx(reference[step], rel=1e-5, abs=1e-6), (step, ours[step], reference[step])


@pytest.mark.slow
@pytest.mark.parametrize("model", in_the_suite(list(MODELS), ["gpt_moe", "hf_mixtral lora"]))
def test_ep_2_trains_ep_1_s_losses(model, ep_runs):
    assert_same_losses(read_train_losses(ep_runs(f"{model} ep 2").run_dir),
                       read_train_losses(ep_runs(f"{model} ep 1").run_dir))
    if "lora" in model:  # the experts' adapters trained, each rank its experts' rows and columns, and written whole
        from safetensors.torch import load_file

        written = [load_file(ep_runs(f"{model} ep {ep}").run_dir / "adapters" / "adapter_model.safetensors")
                   for ep in (2, 1)]
        experts = [name for name in written[1] if "experts" in name and "lora_B" in name]
        assert len(experts) == 4 and all(written[1][name].abs().max() > 1e-4 for name in experts)
        for name, weight in written[1].items():
            torch.testing.assert_close(written[0][name], weight, rtol=0, atol=1e-4)


# (the run whose step-SAVED_AT checkpoint is read, what resumes it): a checkpoint keeps the model's own names, each
# expert once, whatever the layout that wrote or reads it.
RESUMES = {
    "ep 2 -> ep 1": ("gpt_moe ep 2", ("strategy=fsdp",)),
    "ep 1 -> ep 2": ("gpt_moe ep 1", ("strategy=fsdp", "strategy.expert_parallel_size=2")),
    "ep 2 -> ep 4": ("gpt_moe ep 2", ("strategy=fsdp", "strategy.expert_parallel_size=4")),
    "ep 2 -> ddp": ("gpt_moe ep 2", ("strategy=ddp",)),
    "ep 2 -> ZeRO-3": ("gpt_moe ep 2", ("strategy=deepspeed_stage_3",)),
    "hf_mixtral ep 2 -> ep 1": ("hf_mixtral ep 2", ("strategy=fsdp",)),
    "hf_mixtral lora ep 2 -> ep 1": ("hf_mixtral lora ep 2", ("strategy=fsdp",)),
}


@pytest.mark.slow
@pytest.mark.parametrize("resume", in_the_suite(list(RESUMES), ["ep 2 -> ep 1", "hf_mixtral lora ep 2 -> ep 1"]))
def test_a_checkpoint_moves_in_and_out_of_expert_parallelism_with_the_uninterrupted_losses(resume, ep_runs,
                                                                                           tmp_path):
    source, target = RESUMES[resume]
    model = source.removesuffix(" ep 2").removesuffix(" ep 1")
    checkpoint = ep_runs(source).run_dir / "checkpoints" / f"step{SAVED_AT:06d}.ckpt"
    resumed = run_train(tmp_path, *target, *MODELS[model], *EP_RUN, f"ckpt_path={checkpoint}")
    assert resumed.process.returncode == 0, resumed.output[-3000:]
    assert_same_losses(read_train_losses(resumed.run_dir), read_train_losses(ep_runs(f"{model} ep 1").run_dir),
                       range(SAVED_AT, STEPS))


@pytest.mark.slow
@pytest.mark.extended
def test_an_ep_2_checkpoint_exports_the_hub_layout_with_ep_1_s_logits(ep_runs, tmp_path):
    """`lightning-dist export` of a Mixtral trained at ep 2 writes each expert's w1, w2, w3 apart, as ep 1's export
    does, and the two give the same logits (the runs' weights agree to about 1e-5 after 3 steps; an expert written
    in another's place moves them by tenths)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from lightning_dist.models.export import main as export

    folders = {ep: tmp_path / f"ep{ep}" for ep in (1, 2)}
    for ep, folder in folders.items():
        checkpoint = ep_runs(f"hf_mixtral ep {ep}").run_dir / "checkpoints" / f"step{SAVED_AT:06d}.ckpt"
        assert export([str(checkpoint), str(folder)]) == 0
    names = [sorted(load_file(folder / "model.safetensors")) for folder in folders.values()]
    assert names[0] == names[1] and "model.layers.1.block_sparse_moe.experts.7.w3.weight" in names[1]
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [AutoModelForCausalLM.from_pretrained(folder)(ids).logits for folder in folders.values()]
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-4)


# Beside tensor and context parallelism (tp 2 or cp 2, x dp 2): ddp on the 2 data-parallel ranks' batches. The
# balancing loss is over a context-parallel shard's tokens: off for all three.
SPLIT_RUN = (*MODELS["gpt_moe"], "model.balance=0", *EP_RUN)
AXES = {"fsdp_tp": ("strategy=fsdp_tp",), "fsdp cp 2": ("strategy=fsdp", "strategy.context_parallel_size=2")}


@pytest.fixture(scope="module")
def two_rank_ddp(tmp_path_factory):
    run = run_train(tmp_path_factory.mktemp("ep_ddp"), "strategy=ddp", *SPLIT_RUN, "trainer.devices=2")
    assert run.process.returncode == 0, run.output[-3000:]
    return read_train_losses(run.run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("axis", in_the_suite(list(AXES), ["fsdp cp 2"]))
def test_ep_2_beside_tensor_and_context_parallelism_trains_ddp_s_losses(axis, two_rank_ddp, tmp_path):
    run = run_train(tmp_path, *SPLIT_RUN, *AXES[axis], "strategy.expert_parallel_size=2")
    assert run.process.returncode == 0, run.output[-3000:]
    assert_same_losses(read_train_losses(run.run_dir), two_rank_ddp)


@pytest.mark.slow
@pytest.mark.parametrize(("overrides", "line"), [
    (("model=gpt_moe", "strategy.expert_parallel_size=3"), "strategy.expert_parallel_size=3: expert parallelism"
     " splits the experts over ranks among the 4 that FSDP shards each parameter over; choose a size that divides 4"),
    (("model=gpt_moe", "model.n_experts=6", "strategy.expert_parallel_size=4"), "strategy.expert_parallel_size=4:"
     " model.blocks.0.moe.experts has 6 experts, which do not divide over 4 ranks; choose a size that divides 6"),
])
def test_bad_expert_sizes_stop_in_one_line_before_any_rank_starts(overrides, line, tmp_path):
    run = run_train(tmp_path, "strategy=fsdp", "trainer.devices=4", *overrides)
    assert run.process.returncode == 2, run.output[-3000:]
    assert run.process.stderr.strip().splitlines()[-1] == f"error: {line}"
    assert "Initializing distributed" not in run.output


def test_a_step_that_bypasses_the_experts_call_stops_in_one_line():
    from lightning_dist.parallel.expert_parallel.axis import ExpertParallel

    class Split:  # what ExpertParallel holds, for a model whose step never called its experts
        name, calls = "model.blocks.0.moe.experts", 0

    axis = object.__new__(ExpertParallel)
    axis.size, axis.splits = 2, [Split()]
    strategy = type("Strategy", (), {"lightning_module": GPTMoELanguageModel(block_size=16, n_layer=1)})()
    with pytest.raises(RuntimeError) as stopped:
        axis.run_step(strategy, "training_step", lambda batch: torch.zeros(()), None)
    assert str(stopped.value) == (
        "strategy.expert_parallel_size=2: GPTMoELanguageModel's training_step did not call model.blocks.0.moe.experts"
        " as experts(hidden_states, top_k_index, top_k_weights), so its tokens never reached the experts other ranks"
        " hold; call the experts module that way")
