"""Tensor parallelism beside FSDP, on 4 CPU ranks: `fsdp_tp` (2 data-parallel x 2 tensor-parallel) and `hsdp_tp`
(2 x 1 x 2) train the default model, and a transformers Llama, each split by its own plan, with ddp's per-step
losses; ddp runs on the 2 data-parallel ranks, so both see the same batches. (`hsdp_tp` on one node, 1 x 2 x 2, is
`fsdp_tp`'s 2 x 2 mesh and code path: its replicate axis has one member.) DeepSpeed's AutoTP does the same under
ZeRO-1, 2 and 3. These runs are docs/strategies.md's commands too. Gradients are clipped (their norm spans two
meshes), activation checkpointing is on in two of them, and every rank holds the shards the layout says."""

from __future__ import annotations

import json

import pytest

from lightning_dist.reports.equivalence import read_train_losses
from tests.conftest import REPO, in_the_suite, run_train

pytestmark = pytest.mark.slow

STEPS = 10  # enough for a wrong split or a missing all-reduce to move a loss past 1e-5
COMMON = (f"trainer.max_steps={STEPS}", "test=false", "trainer.log_every_n_steps=1", "trainer.gradient_clip_val=1.0",
          "+callbacks.shards._target_=tests.probes.ShardShapes", "+callbacks.shards.directory=${paths.output_dir}")
LLAMA = ("model=hf_llama",)
LAYOUTS = {
    "fsdp_tp 2x2": ("strategy=fsdp_tp",),
    "hsdp_tp 2x1x2, activation checkpointing": ("strategy=hsdp_tp", "strategy.data_parallel_replicate_size=2",
                                                "strategy.activation_checkpointing=true"),
    # A transformers Llama built from its config, split by its own base_model_tp_plan (grouped-query attention:
    # 4 query heads and 2 key/value heads, one of each kind per rank), its decoder layers checkpointed.
    "hf_llama fsdp_tp 2x2, activation checkpointing": (*LLAMA, "strategy=fsdp_tp", "strategy.activation_checkpointing=true"),
    # DeepSpeed AutoTP splits the same Llama's linear layers by its own rules, under ZeRO-1, 2 and 3 (DeepSpeed
    # 0.19.8 trains AutoTP under ZeRO-3 too).
    "hf_llama deepspeed_stage_1 autotp 2x2": (*LLAMA, "strategy=deepspeed_stage_1", "strategy.tensor_parallel_size=2"),
    "hf_llama deepspeed_stage_2 autotp 2x2": (*LLAMA, "strategy=deepspeed_stage_2", "strategy.tensor_parallel_size=2"),
    "hf_llama deepspeed_stage_3 autotp 2x2": (*LLAMA, "strategy=deepspeed_stage_3", "strategy.tensor_parallel_size=2"),
}
REFERENCES = {"ddp": ("strategy=ddp",), "hf_llama ddp": (*LLAMA, "strategy=ddp")}
# Local shapes of gpt_tiny's parameters (d_model 128, MLP 512, 256 bytes): q and the first MLP layer split by rows
# across the 2 tensor-parallel ranks, the attention output and second MLP layer by columns; then FSDP shards dim 0
# over the data-parallel ranks that shard (2, or 1 under 2 x 1 x 2). A norm is not split, only sharded. (The root's
# parameters, the embeddings, are gathered at this point: FSDP keeps the root whole from forward to backward.)
SHARDED_OVER_2 = {"model.blocks.0.attn.q.weight": [32, 128], "model.blocks.0.attn.q.bias": [32],
                  "model.blocks.0.attn.proj.weight": [64, 64], "model.blocks.0.mlp.0.weight": [128, 128],
                  "model.blocks.0.mlp.2.weight": [64, 256], "model.blocks.0.ln_attn.weight": [64]}
SHARDED_OVER_1 = {"model.blocks.0.attn.q.weight": [64, 128], "model.blocks.0.attn.q.bias": [64],
                  "model.blocks.0.attn.proj.weight": [128, 64], "model.blocks.0.mlp.0.weight": [256, 128],
                  "model.blocks.0.mlp.2.weight": [128, 256], "model.blocks.0.ln_attn.weight": [128]}

# The Llama (hidden 128, head_dim 32, 2 key/value heads, MLP 344): q_proj and k_proj split by rows over 2 ranks,
# o_proj and down_proj by columns, then sharded over 2; its norm only sharded.
LLAMA_SHARDS = {"model.model.layers.0.self_attn.q_proj.weight": [32, 128],
                "model.model.layers.0.self_attn.k_proj.weight": [16, 128],
                "model.model.layers.0.self_attn.o_proj.weight": [64, 64],
                "model.model.layers.0.mlp.down_proj.weight": [64, 172],
                "model.model.layers.0.input_layernorm.weight": [64]}

# AutoTP's split of the Llama (under ZeRO-3, before ZeRO partitions each split part further).
AUTOTP_SHARDS = {"model.model.layers.0.self_attn.q_proj.weight": [64, 128],
                 "model.model.layers.0.self_attn.k_proj.weight": [32, 128],
                 "model.model.layers.0.self_attn.o_proj.weight": [128, 64],
                 "model.model.layers.0.mlp.down_proj.weight": [128, 172],
                 "model.model.layers.0.input_layernorm.weight": [128]}


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    runs = {}

    def get(name: str):
        if name not in runs:
            devices = 2 if name in REFERENCES else 4
            overrides = REFERENCES.get(name) or LAYOUTS[name]
            runs[name] = run_train(tmp_path_factory.mktemp("tp"), *overrides, f"trainer.devices={devices}", *COMMON)
            assert runs[name].process.returncode == 0, runs[name].output[-3000:]
        return runs[name]

    return get


# In the suite: each tensor-parallel engine once, FSDP's on our GPT and DeepSpeed's AutoTP on a transformers Llama
# (HSDP, FSDP's on the Llama, AutoTP under ZeRO-1 and ZeRO-3: scripts/extended_checks.sh; HSDP trains in CI's
# compatibility tier too).
@pytest.mark.parametrize("layout", in_the_suite(list(LAYOUTS), ["fsdp_tp 2x2"]))
def test_tensor_parallel_layouts_train_ddps_losses_and_hold_the_expected_shards(layout, tp_runs):
    reference_name = "hf_llama ddp" if layout.startswith("hf_llama") else "ddp"
    reference, run = read_train_losses(tp_runs(reference_name).run_dir), read_train_losses(tp_runs(layout).run_dir)
    assert sorted(run) == sorted(reference) == list(range(STEPS))
    for step, loss in reference.items():
        assert run[step] == pytest.approx(loss, rel=1e-5), step
    expected = (AUTOTP_SHARDS if "autotp" in layout else LLAMA_SHARDS if layout.startswith("hf_llama")
                else SHARDED_OVER_1 if "2x1x2" in layout else SHARDED_OVER_2)
    for rank in range(4):
        shapes = json.loads((tp_runs(layout).run_dir / f"shards_rank{rank}.json").read_text())
        assert {name: shapes[name] for name in expected} == expected, rank
    summary = json.loads((tp_runs(layout).run_dir / "metrics.json").read_text())
    assert summary["world_size"] == 4


@pytest.mark.extended  # its runs beyond the layouts' (tests/recipes/test_hf_causal_lm.py exports a model in the suite)
def test_the_tensor_parallel_llamas_checkpoint_exports_as_a_save_pretrained_folder_with_its_logits(tp_runs, tmp_path):
    import torch
    import transformers

    from lightning_dist.checkpoints.consolidate import load_consolidated
    from lightning_dist.models.export import main as export
    from lightning_dist.models.hf_language_model import HFLanguageModel

    checkpoint = tp_runs("hf_llama fsdp_tp 2x2, activation checkpointing").run_dir / "checkpoints" / "last.ckpt"
    assert (checkpoint / ".metadata").is_file()  # each rank's 2-D shards, as DCP wrote them
    assert export([str(checkpoint), str(tmp_path / "llama")]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama").eval()
    saved = load_consolidated(checkpoint)
    trained = HFLanguageModel(**saved["hyper_parameters"])
    trained.load_state_dict(saved["state_dict"])
    untrained = HFLanguageModel(**saved["hyper_parameters"]).model.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(exported.model.layers[0].self_attn.q_proj.weight, untrained)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (exported(input_ids=tokens).logits - trained.eval()(tokens)).abs().max().item() <= 1e-5


@pytest.mark.extended  # two more runs beyond the layouts' (the AutoTP layout itself trains in the suite)
def test_an_autotp_checkpoint_resumes_under_its_size_and_is_refused_elsewhere_in_one_line(tp_runs, tmp_path, capsys):
    from lightning_dist.checkpoints.consolidate import main as consolidate

    autotp, ddp = tp_runs("hf_llama deepspeed_stage_2 autotp 2x2"), tp_runs("hf_llama ddp")
    checkpoint = autotp.run_dir / "checkpoints" / "last.ckpt"
    more = (f"trainer.max_steps={STEPS + 2}", "test=false", "trainer.log_every_n_steps=1",
            "trainer.gradient_clip_val=1.0")
    resumed = {
        name: run_train(tmp_path / name, *LAYOUTS.get(name) or REFERENCES[name], f"trainer.devices={devices}", *more,
                        f"ckpt_path={run.run_dir / 'checkpoints' / 'last.ckpt'}")
        for name, run, devices in (("hf_llama deepspeed_stage_2 autotp 2x2", autotp, 4), ("hf_llama ddp", ddp, 2))
    }
    losses = {name: read_train_losses(run.run_dir) for name, run in resumed.items()}
    resumed_steps = [STEPS, STEPS + 1]
    assert sorted(losses["hf_llama ddp"]) == sorted(losses["hf_llama deepspeed_stage_2 autotp 2x2"]) == resumed_steps
    for step, loss in losses["hf_llama ddp"].items():
        assert losses["hf_llama deepspeed_stage_2 autotp 2x2"][step] == pytest.approx(loss, rel=1e-5), step

    refusal = ("is a DeepSpeed AutoTP checkpoint (tensor-parallel size 2): it resumes under a DeepSpeed strategy with"
               " strategy.tensor_parallel_size=2; moving it to another layout or one file is not supported yet")
    elsewhere = run_train(tmp_path / "fsdp", *LLAMA, "strategy=fsdp", f"ckpt_path={checkpoint}")
    assert elsewhere.process.returncode == 2
    assert elsewhere.process.stderr.strip().splitlines()[-1] == f"error: ckpt_path: {checkpoint} {refusal}"
    assert consolidate([str(checkpoint), str(tmp_path / "one.ckpt")]) == 2
    assert capsys.readouterr().err == f"error: checkpoint: {checkpoint} {refusal}\n"
    assert not (tmp_path / "one.ckpt").exists()


# Qwen3's q and k norms: one weight per head dimension, applied to each head, which tensor parallelism splits over the
# ranks; each rank's gradient of the weight is its own heads' part, summed over the ranks (its plan's
# replicated_with_grad_allreduce). Without the sum the ranks' copies drift apart: measured, the norms' weights 6.4e-3
# off the reference's after 4 steps under fsdp_tp, and AutoTP's losses 3.9e-6 off at step 2 (a LightningModule has no
# `config` for DeepSpeed to read the plan from: it split by its name rules, without the sum).
QWEN3 = ("model=hf_llama", "model.model_type=qwen3", "+model.config.head_dim=32", "data.batch_size=2",
         "data.block_size=32", "trainer.max_steps=4", "trainer.log_every_n_steps=1", "trainer.limit_val_batches=0",
         "test=false", "trainer.gradient_clip_val=0.5")
QWEN3_RUNS = {"fsdp": ("strategy=fsdp", "trainer.devices=2"),  # the reference: the 2 data-parallel ranks
              "fsdp_tp": ("strategy=fsdp_tp", "trainer.devices=4", "strategy.activation_checkpointing=true"),
              "autotp": ("strategy=deepspeed_stage_3", "strategy.tensor_parallel_size=2", "trainer.devices=4")}


def test_qwen3_s_per_head_norms_sum_their_gradients_over_the_tensor_parallel_ranks(tmp_path):
    import torch

    from lightning_dist.checkpoints.consolidate import consolidate_checkpoint

    runs = {name: run_train(tmp_path / name, *QWEN3, *overrides) for name, overrides in QWEN3_RUNS.items()}
    for name, run in runs.items():
        assert run.process.returncode == 0, (name, run.output[-3000:])
    reference = read_train_losses(runs["fsdp"].run_dir)
    for name in ("fsdp_tp", "autotp"):
        losses = read_train_losses(runs[name].run_dir)
        assert sorted(losses) == sorted(reference) == list(range(4))
        for step, loss in reference.items():
            assert losses[step] == pytest.approx(loss, rel=1e-6), (name, step)
    weights = {}
    for name in ("fsdp", "fsdp_tp"):
        consolidated = consolidate_checkpoint(runs[name].run_dir / "checkpoints" / "last.ckpt", tmp_path / f"{name}.ckpt")
        weights[name] = torch.load(consolidated, map_location="cpu", weights_only=True)["state_dict"]
    norms = [name for name in weights["fsdp"] if name.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(norms) == 8  # 4 layers, a q and a k norm each
    for name in norms:
        torch.testing.assert_close(weights["fsdp_tp"][name], weights["fsdp"][name], rtol=0, atol=1e-6)


# transformers' plans in their other styles, on 2 ranks against one: Phi-3's fused projections, their outputs gathered
# and their inputs split (refused before), and DeepSeek-V3's latent attention, whose rotary key reaches every head
# unsplit: each rank's gradient of it is its own heads' part, summed over the ranks (`mla_kv_a_proj`). Without the sum
# both fsdp_tp and AutoTP drifted, silently: 5.478574 against 5.478742 at step 1.
DEEPSEEK_V3 = ("model.model_type=deepseek_v3", "+model.config.n_routed_experts=4", "+model.config.moe_intermediate_size=64",
               "+model.config.kv_lora_rank=32", "+model.config.q_lora_rank=64", "+model.config.qk_rope_head_dim=16",
               "+model.config.qk_nope_head_dim=16", "+model.config.v_head_dim=32", "+model.config.first_k_dense_replace=1",
               "+model.config.n_group=1", "+model.config.topk_group=1", "+model.config.num_experts_per_tok=2")
SMALL_RUN = ("model=hf_llama", "data.batch_size=2", "data.block_size=32", "trainer.max_steps=3",
             "trainer.log_every_n_steps=1", "trainer.limit_val_batches=0", "test=false")
OTHER_STYLES = {"phi3": ("model.model_type=phi3",), "deepseek_v3": DEEPSEEK_V3}
TWO_RANKS = {"fsdp_tp": ("strategy=fsdp_tp", "trainer.devices=2"),
             "autotp": ("strategy=deepspeed_stage_2", "strategy.tensor_parallel_size=2", "trainer.devices=2")}


@pytest.mark.parametrize(("model", "runs"), [("phi3", ["fsdp_tp"]), ("deepseek_v3", ["fsdp_tp", "autotp"])])
def test_gathered_outputs_split_inputs_and_deepseek_s_rotary_key_train_one_rank_s_losses(model, runs, tmp_path):
    reference = run_train(tmp_path / "one_rank", *SMALL_RUN, *OTHER_STYLES[model], "strategy=ddp", "trainer.devices=1")
    assert reference.process.returncode == 0, reference.output[-3000:]
    expected = read_train_losses(reference.run_dir)
    assert sorted(expected) == [0, 1, 2]
    for name in runs:
        run = run_train(tmp_path / name, *SMALL_RUN, *OTHER_STYLES[model], *TWO_RANKS[name])
        assert run.process.returncode == 0, (name, run.output[-3000:])
        losses = read_train_losses(run.run_dir)
        assert sorted(losses) == sorted(expected)
        for step, loss in expected.items():
            assert losses[step] == pytest.approx(loss, rel=1e-6), (name, step, losses[step], loss)


@pytest.mark.parametrize("layout", ["fsdp_tp 2x2", "hf_llama deepspeed_stage_2 autotp 2x2"])
def test_the_memory_plan_of_a_tensor_parallel_layout_is_within_15_percent_of_what_each_rank_holds(layout, tp_runs):
    import yaml

    from lightning_dist.memory import ModelFacts, layout_of, plan_memory
    from lightning_dist.models.gpt import GPTLanguageModel
    from lightning_dist.models.hf_language_model import HFLanguageModel
    from lightning_dist.strategies.presets import PRESETS

    if layout.startswith("hf_llama"):
        llama = yaml.safe_load((REPO / "lightning_dist" / "conf" / "model" / "hf_llama.yaml").read_text())
        config = {**llama["config"], "max_position_embeddings": 256}  # ${data.block_size}: positions have no weights
        facts, name = ModelFacts.of(lambda: HFLanguageModel("llama", config)), "deepspeed_stage_2"
        strategy = PRESETS[name].strategy(**PRESETS[name].kwargs, tensor_parallel_size=2)
    else:
        facts, name = ModelFacts.of(GPTLanguageModel), "fsdp_tp"
        strategy = PRESETS[name].strategy(**PRESETS[name].kwargs)
    planned = plan_memory(facts, layout_of(strategy, name), "32-true", devices=4).model_state_per_device
    measured = [rank["cpu"] for rank in json.loads((tp_runs(layout).run_dir / "metrics.json").read_text())["model_state_bytes_per_rank"]]
    print(f"{layout}: planned {planned / 1e6:.2f} MB per rank, measured {[f'{m / 1e6:.2f}' for m in measured]} MB")
    assert len(measured) == 4
    for held in measured:
        assert abs(held - planned) / held < 0.15
