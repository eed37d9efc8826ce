"""A user's fine-tuning script (tests/finetune_script.py) on 2 CPU ranks under each engine and axis: weights loaded
in each place users load them are the weights trained (the first loss is the pretrained model's on that batch, in
one plain process), `lightning_dist.from_pretrained` trains ddp's losses, and LoRA trains only its adapters."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import REPO, TRAIN_ENV, cpu_has_bf16
from tests.finetune_script import GROUPED

pytestmark = pytest.mark.slow

TRANSFORMERS_PLACES = ["configure_model", "init_module", "init", "load_state_dict"]
ONE_RANK = "ld_ddp@1"  # ddp on one rank: the reference where the 2 ranks split one batch (tp 2, pp 2, cp 2)
# What each run trains: every place under fsdp, ZeRO-3, tensor parallelism and pipeline stages (whose last stage
# answers `labels=` with the loss); LoRA under every engine and axis; ddp for reference.
RUNS = {
    "ld_ddp": ["ours", "all_gather", "model_output", "lora", "lora_checkpointed", "lora_bf16_base", "qlora",
               "qlora_bf16", *GROUPED],
    ONE_RANK: ["lora"],
    "ld_fsdp": [*TRANSFORMERS_PLACES, "ours", "lora", "lora_checkpointed", "lora_bf16_base", "qlora", "qlora_bf16"],
    "ld_deepspeed_stage_3": [*TRANSFORMERS_PLACES, "ours", "model_output", "lora", "lora_checkpointed",
                             "lora_bf16_base", "qlora_configure_model", "qlora_bf16", *GROUPED],
    "ld_fsdp_tp": [*TRANSFORMERS_PLACES, "ours", "lora"],
    "ld_fsdp_pp": [*TRANSFORMERS_PLACES, "ours", "model_output", "lora"],
    "ld_fsdp:context_parallel_size=2": ["lora"],
    "ld_deepspeed_stage_2": ["lora", "lora_bf16_base", *GROUPED],
    # LoRA where ZeRO-3 and LoRA broke together (transformers #47254, DeepSpeed #8148): checkpointing, offload.
    "ld_fsdp_activation_checkpointing": ["lora"],
    "ld_deepspeed_stage_3:activation_checkpointing": ["lora"],
    "ld_deepspeed_stage_3_offload": ["lora", "lora_bf16_base"],
}
# Each rank trains its own batches (data parallel): ddp's losses, rank by rank.
LORA_DATA_PARALLEL = ["ld_fsdp", "ld_deepspeed_stage_2", "ld_deepspeed_stage_3", "ld_fsdp_activation_checkpointing",
                      "ld_deepspeed_stage_3:activation_checkpointing", "ld_deepspeed_stage_3_offload"]
# The 2 ranks split each batch: one rank's losses.
LORA_SPLIT = ["ld_fsdp_tp", "ld_fsdp_pp", "ld_fsdp:context_parallel_size=2"]
# Activation checkpointing's wrapper is in the tuner layers' names PEFT picks the entries by: it wrote an empty file.
SAVED_ADAPTERS = ["ld_fsdp", "ld_deepspeed_stage_3", "ld_fsdp_tp", "ld_fsdp_pp", "ld_fsdp_activation_checkpointing",
                  "ld_deepspeed_stage_3:activation_checkpointing"]
# Mixtral by `lightning_dist.from_pretrained`: its files name each expert (w1, w2, w3), as the Hub's do, which
# transformers' mapping fuses as each rank initialises its shards (transformers' own loader: llama's places).
OTHER_MODELS_PLACES = {"qwen2": ["configure_model", "ours"], "mixtral": ["ours"]}


@pytest.fixture(scope="module")
def runs(pretrained_folders, tmp_path_factory, deepspeed_ops):
    """{(strategy, model): {place: [each rank's result]}}, each run made on first use."""

    class Runs(dict):
        def __missing__(self, key):
            strategy, model = key
            places = RUNS[strategy] if model == "llama" else OTHER_MODELS_PLACES[model]
            name, _, one = strategy.partition("@")
            ranks = 1 if one else 2
            out = tmp_path_factory.mktemp(strategy.replace(":", "-").replace("=", "-").replace("@", "-") + f"-{model}")
            process = subprocess.run(
                [sys.executable, str(REPO / "tests" / "finetune_script.py"), str(out), str(pretrained_folders[model]),
                 name, ",".join(places), str(ranks)],
                cwd=out, env={**TRAIN_ENV, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=900)
            assert process.returncode == 0, process.stderr[-4000:]
            self[key] = {place: [json.loads((out / f"{place}.rank{rank}.json").read_text()) for rank in range(ranks)]
                         for place in places}
            self[key]["out"] = out
            return self[key]

    return Runs()


def pretrained_loss(folder, batch: list, dtype: torch.dtype | None) -> float:
    """The pretrained model's loss on `batch`, in one plain process (`dtype` None: transformers' default, the
    folder's bf16)."""
    model = AutoModelForCausalLM.from_pretrained(folder, **({} if dtype is None else {"dtype": dtype}))
    ids = torch.tensor(batch)
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()


def first_loss(results: list[dict]) -> tuple[float, list]:
    """The first step's loss and batch on a rank that computed it: under pipeline stages the last stage runs the
    step once per microbatch (2 here, of equal size), so its first two losses average to the batch's."""
    result = next(r for r in results if r["losses"])
    return sum(result["losses"][:2]) / 2 if len(result["losses"]) > 3 else result["losses"][0], result["first_batch"]


def test_a_collective_in_the_last_stage_s_part_of_the_step_stops_in_one_line_not_a_hang(runs, pretrained_folders,
                                                                                        tmp_path):
    """`self.all_gather(loss)` in a step, as users log a mean over ranks: under ddp it runs (the losses are those of
    the same step without it); under pipeline stages only the last stage runs the step after its model call, and
    the collective waited for ranks that never join (still waiting 120 s on, and after a SIGTERM, until killed).
    Now it stops in one line."""
    assert [r["losses"] for r in runs["ld_ddp", "llama"]["all_gather"]] == [r["losses"] for r in runs["ld_ddp", "llama"]["ours"]]
    process = subprocess.run(
        [sys.executable, str(REPO / "tests" / "finetune_script.py"), str(tmp_path), str(pretrained_folders["llama"]),
         "ld_fsdp_pp", "all_gather", "2"],
        cwd=tmp_path, env={**TRAIN_ENV, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert process.returncode != 0
    refusal = ("ValueError: strategy.pipeline_parallel_size=2: training_step calls self.all_gather after its call of the"
               " model, a part of the step only the last pipeline stage runs, so the other stages' ranks would never"
               " join it; log the value instead (self.log(name, value, sync_dist=True)): every stage logs the last"
               " stage's values")
    assert any(line.endswith(refusal) for line in process.stderr.splitlines())  # "[rank1]: " before it, or not


@pytest.mark.parametrize("strategy", ["ld_ddp", "ld_deepspeed_stage_3", "ld_fsdp_pp"])
def test_a_step_returning_its_forward_s_model_output_trains_as_one_returning_the_loss(runs, strategy):
    """The module's own forward returns the model's `ModelOutput`, which the step logs `.loss` of and returns whole
    (Lightning takes its "loss"): under pipeline stages too, every rank's losses are those of the step returning
    the loss tensor."""
    run = runs[strategy, "llama"]
    assert [r["losses"] for r in run["model_output"]] == [r["losses"] for r in run["ours"]]
    assert any(r["losses"] for r in run["model_output"])


CASES = [(strategy, "llama", place) for strategy, places in RUNS.items() for place in places
         if place not in ("all_gather", "model_output", "lora", "lora_checkpointed", "lora_bf16_base", *GROUPED)
         and not place.startswith("qlora") and not strategy.startswith("ld_ddp")] + [
    ("ld_fsdp", "qwen2", "configure_model"), ("ld_fsdp", "qwen2", "ours")]


@pytest.mark.parametrize("strategy,model,place", CASES, ids=["-".join(case) for case in CASES])
def test_the_first_step_starts_from_the_pretrained_weights(runs, pretrained_folders, strategy, model, place):
    loss, batch = first_loss(runs[strategy, model][place])
    # transformers' own from_pretrained keeps the folder's bf16, ours reads into the run's precision: either way the
    # weights train in fp32 under 32-true (the strategy casts the trainable ones, or ZeRO-3 its config's dtype).
    expected = pretrained_loss(pretrained_folders[model], batch, torch.float32)
    assert loss == pytest.approx(expected, rel=1e-5)
    assert expected < 3.0  # a fresh model's is about 5.5: the weights trained are the folder's


def step_losses(strategy: str, results: list[dict]) -> list[float]:
    """The per-step losses of the batch the ranks split: a pipeline's last stage runs the step once per microbatch (2
    here, of equal size), whose two losses average to the batch's; under context parallelism each rank's loss is its
    shard's share, and the ranks' mean (what the step logs) is the whole sequence's."""
    if "context_parallel" in strategy:
        return [sum(step) / len(step) for step in zip(*(r["losses"] for r in results))]
    losses = next(r for r in results if r["losses"])["losses"]
    return [sum(losses[i:i + 2]) / 2 for i in range(0, len(losses), 2)] if len(losses) > 3 else losses


@pytest.mark.parametrize("strategy,place", [
    ("ld_fsdp", "ours"), ("ld_deepspeed_stage_3", "ours"), *((strategy, "lora") for strategy in LORA_DATA_PARALLEL),
    ("ld_fsdp", "lora_checkpointed"), ("ld_deepspeed_stage_3", "lora_checkpointed"),
    ("ld_fsdp", "lora_bf16_base")])
def test_the_sharded_engines_train_ddp_s_losses(runs, strategy, place):
    reference, run = runs["ld_ddp", "llama"][place], runs[strategy, "llama"][place]
    for ours, theirs in zip(run, reference):
        assert len(ours["losses"]) == (6 if place == "lora_checkpointed" else 3)  # 2 microbatches a step
        assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-5)


@pytest.mark.parametrize("strategy", ["ld_fsdp", "ld_deepspeed_stage_3"])
def test_a_pretrained_mixture_of_experts_trains_from_its_weights_with_its_balancing_loss(runs, pretrained_folders,
                                                                                      strategy):
    """Mixtral (transformers' fused experts), loaded by `lightning_dist.from_pretrained` from a folder that holds each
    expert's weights apart (the Hub's layout), its step's `.loss` holding the router's
    load-balancing loss (`output_router_logits` in its config): the first loss is the folder's model's on that batch
    (read into fp32, as transformers reads it), balancing loss included. (That each rank reads and stacks the right
    experts into its shards shows there; the routed layers' training under each engine: test_gpt_moe.py.)"""
    run = runs[strategy, "mixtral"]["ours"]
    assert [len(rank["losses"]) for rank in run] == [3, 3]
    loss, batch = first_loss(run)
    model = AutoModelForCausalLM.from_pretrained(pretrained_folders["mixtral"], dtype=torch.float32)
    ids = torch.tensor(batch)
    with torch.no_grad():
        balanced = model(input_ids=ids, labels=ids)
        plain = model(input_ids=ids, labels=ids, output_router_logits=False).loss.item()
    assert loss == pytest.approx(balanced.loss.item(), rel=1e-5) and balanced.aux_loss > 0
    assert balanced.loss.item() - plain == pytest.approx(model.config.router_aux_loss_coef * balanced.aux_loss.item(),
                                                         rel=1e-3)


@pytest.mark.parametrize("strategy", LORA_SPLIT)
def test_lora_under_tensor_pipeline_and_context_parallelism_trains_one_rank_s_losses(runs, strategy):
    (reference,) = runs[ONE_RANK, "llama"]["lora"]
    assert len(reference["losses"]) == 3
    # Context parallelism with labels=: each shard's loss needs the labels after its last token, in the next shard
    # (a shard alone lost that prediction: 2.0114 against one rank's 1.9979 at the first step).
    assert step_losses(strategy, runs[strategy, "llama"]["lora"]) == pytest.approx(reference["losses"], rel=1e-5)


@pytest.mark.parametrize("strategy", ["ld_ddp", "ld_fsdp"])
def test_float32_adapters_train_on_a_bf16_base_keeping_both_dtypes(runs, strategy):
    """PEFT makes a bf16 model's adapters float32 (its default): FSDP2 refused that mix ("FSDP expects uniform
    original parameter dtype", accelerate #3985); fsdp trains it as ddp does (the losses: above), the base left bf16
    and unchanged."""
    for result in runs[strategy, "llama"]["lora_bf16_base"]:
        assert result["dtypes"] == {"adapters": ["torch.float32"], "base": ["torch.bfloat16"]}
        assert result["base_unchanged"] and result["adapters_changed"] and result["lora_b_start_max"] == 0.0
        assert result["optimizer_state_elements"] == (2 * result["adapter_parameters"] if strategy == "ld_ddp"
                                                      else result["adapter_parameters"])  # a half on each of 2 ranks


@pytest.mark.parametrize("strategy", ["ld_deepspeed_stage_2", "ld_deepspeed_stage_3", "ld_deepspeed_stage_3_offload"])
def test_deepspeed_keeps_a_bf16_base_as_loaded_under_32_true(runs, strategy):
    """Lightning's DeepSpeed precision cast the whole module to float32 under 32-true: the bf16 base took twice its
    memory under DeepSpeed only, and computed other losses than ddp's bf16 base (up to 6.9e-4 apart, the first step's
    too). Now it stays bf16 beside the float32 adapters under every ZeRO stage and trains ddp's steps: ZeRO-2's
    exactly, ZeRO-3's apart from the third step on, its gradients through the bf16 base rounded otherwise (up to
    2.3e-4 measured; models all in float32 train ddp's losses exactly under ZeRO-3)."""
    reference = runs["ld_ddp", "llama"]["lora_bf16_base"]
    for result, theirs in zip(runs[strategy, "llama"]["lora_bf16_base"], reference):
        assert result["dtypes"] == {"adapters": ["torch.float32"], "base": ["torch.bfloat16"]}
        assert result["losses"][0] == theirs["losses"][0]
        assert result["losses"] == pytest.approx(theirs["losses"], rel=1e-6 if strategy.endswith("2") else 1e-3)
        assert result["base_unchanged"] and result["adapters_changed"]


@pytest.mark.parametrize("strategy", ["ld_deepspeed_stage_2", "ld_deepspeed_stage_3"])
@pytest.mark.parametrize("place", GROUPED)
def test_an_optimizer_grouped_for_weight_decay_trains_a_lora_model_as_under_ddp(runs, strategy, place):
    """The optimizer's groups as users split them for weight decay, on a LoRA model. DeepSpeed stopped ZeRO-1/2 on a
    group of frozen weights only (`IndexError: list index out of range`, DeepSpeed #4055), and dropped an empty group
    from the list the warmup steps (`ValueError: zip() argument 2 is longer than argument 1`, torch 2.13): both train
    ddp's losses, at ddp's rates."""
    reference = runs["ld_ddp", "llama"][place]
    for result, theirs in zip(runs[strategy, "llama"][place], reference):
        assert result["learning_rates"] == theirs["learning_rates"] == [5e-4, 1e-3, 1e-3]
        assert result["losses"] == pytest.approx(theirs["losses"], rel=1e-6 if strategy.endswith("2") else 1e-3)
        assert result["dtypes"] == {"adapters": ["torch.float32"], "base": ["torch.bfloat16"]}


def test_zero_3_releases_every_partitioned_parameter_after_each_checkpointed_microbatch(runs):
    """LoRA, the model's own gradient checkpointing and 2 microbatches a step under ZeRO-3: after each microbatch's
    backward no partitioned parameter is left gathered (DeepSpeed #8148: frozen ones stayed gathered after their
    recompute, so memory grew with every microbatch). The bytes its parameters hold whole are those of the ones it
    keeps whole once used (the small ones, under its persistence threshold: 751,872 here), from the second
    microbatch on; the first has used some of them only (measured 65,536)."""
    for result in runs["ld_deepspeed_stage_3", "llama"]["lora_checkpointed"]:
        assert result["gathered_after_backward"] == [0] * 6
        persistent, held = result["persistent_bytes"], result["held_after_backward"]
        assert persistent > 0 and held[0] < persistent and held[1:] == [persistent] * 5, (held, persistent)


@pytest.mark.parametrize("strategy", ["ld_ddp", *LORA_DATA_PARALLEL, *LORA_SPLIT])
def test_lora_trains_only_its_adapters_from_b_zero(runs, strategy):
    # r 4 on q and o (64 -> 64: 4 x 64 + 64 x 4) and k and v (64 -> 32: 4 x 64 + 32 x 4), in each of 4 layers.
    adapters = 4 * (2 * 512 + 2 * 384)
    # Adam's two moments for the adapters only: whole under ddp, a shard of them per rank under the engines that
    # shard; a stage's layers' under pipeline stages (2 of the 4 layers), a rank's share of the split factors
    # under tensor parallelism (B of q, k and v by rows, A of o by columns; the other factors whole).
    split_by_tp = 4 * (64 * 4 + 32 * 4 * 2 + 4 * 64)
    per_rank = {"ld_ddp": 2 * adapters, "ld_fsdp_pp": adapters, "ld_fsdp_tp": 2 * (adapters - split_by_tp // 2)}
    for result in runs[strategy, "llama"]["lora"]:
        assert result["lora_b_start_max"] == 0.0
        assert result["base_names"] == 39 and result["base_unchanged"]  # bit-identical after 3 steps
        assert result["adapters_changed"]
        assert result["adapter_parameters"] == adapters
        assert result["trainable"] == (adapters // 2 if strategy == "ld_fsdp_pp" else adapters)  # a stage's layers
        assert result["optimizer_state_elements"] == per_rank.get(strategy, adapters)


@pytest.mark.parametrize("strategy", SAVED_ADAPTERS)
def test_adapters_are_written_whole_in_peft_s_format_and_load_with_the_trained_logits(runs, pretrained_folders,
                                                                                      strategy):
    """Each rank holds a shard (fsdp) or a partition (ZeRO-3) of every adapter: what is written is all of it
    (accelerate #4206, DeepSpeed #7900), and PEFT's own loader gives the trained model's logits."""
    from peft import PeftModel
    from safetensors.torch import load_file

    import lightning_dist

    out = runs[strategy, "llama"]["out"]
    folder = out / f"adapters-{strategy.replace(':', '-')}"
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    trained = torch.load(out / "trained_adapters.pt")
    saved = load_file(folder / "adapter_model.safetensors")
    assert len(saved) == len(trained) == 32
    for name, value in trained.items():
        assert torch.equal(saved[name.replace(".default.", ".")], value), name  # PEFT drops the adapter's name
    loaded = PeftModel.from_pretrained(lightning_dist.from_pretrained(pretrained_folders["llama"]), folder)
    for name, value in trained.items():
        assert torch.equal(loaded.get_parameter(name), value), name
    assert any(value.abs().max() > 0 for name, value in trained.items() if "lora_B" in name)  # trained off B = 0


def test_qlora_trains_its_adapters_on_the_4_bit_base_under_ddp(runs, pretrained_folders):
    """QLoRA as users write it (the base loaded in 4 bits, NF4 in float32 storage; LoRA) under ddp, which keeps
    every rank's weights whole: the first loss is the 4-bit model's in one plain process, the packed base weights
    end bit-identical, and only the adapters train."""
    from tests.finetune_script import quantized_with_lora

    adapters = 4 * (2 * 512 + 2 * 384)
    model = quantized_with_lora(str(pretrained_folders["llama"]))
    for result in runs["ld_ddp", "llama"]["qlora"]:
        ids = torch.tensor(result["first_batch"])
        with torch.no_grad():
            expected = model(input_ids=ids, labels=ids).loss.item()
        # bitsandbytes' CPU kernels take other paths by mode (one batch: 2.06999 in eval, 2.07005 in train mode, 2.07002
        # in the run): 4-bit arithmetic agrees to 1e-4.
        assert result["losses"][0] == pytest.approx(expected, rel=1e-4)
        assert expected < 3.0  # the folder's weights, in 4 bits (a fresh model's loss is about 5.5)
        assert result["base_unchanged"] and result["adapters_changed"] and result["lora_b_start_max"] == 0.0
        assert result["trainable"] == result["adapter_parameters"] == adapters
        assert result["optimizer_state_elements"] == 2 * adapters


@pytest.mark.parametrize("strategy,place", [("ld_fsdp", "qlora"), ("ld_deepspeed_stage_3", "qlora_configure_model")])
def test_qlora_trains_ddp_s_losses_on_a_4_bit_base_that_fsdp_and_zero_3_shard(runs, strategy, place):
    """The 4-bit base in float32 storage, built in `__init__` (FSDP2) or in `configure_model` (ZeRO-3, under
    zero.Init): each rank holds half the packed bytes, and the steps are ddp's, where the base stays whole. Before,
    bitsandbytes' CPU kernel re-laid the weight out in place on an eval-mode forward, which the shards never saw: the
    second step's loss was 2.3410 where ddp's is 2.1443, with no error."""
    for ours, theirs in zip(runs[strategy, "llama"][place], runs["ld_ddp", "llama"]["qlora"]):
        assert ours["first_batch"] == theirs["first_batch"]
        assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-5)
        assert ours["quantized_bytes_held"] * 2 == theirs["quantized_bytes_held"] == 73728
        assert ours["base_unchanged"] and ours["adapters_changed"] and ours["lora_b_start_max"] == 0.0
        assert ours["optimizer_state_elements"] == ours["adapter_parameters"]  # half of Adam's two states a rank


@pytest.mark.parametrize("strategy", ["ld_fsdp", "ld_deepspeed_stage_3"])
def test_qlora_in_bf16_storage_trains_bf16_mixed_close_to_ddp(runs, strategy):
    """What QLoRA users on GPUs write: bf16 storage and compute, bf16-mixed. FSDP2 gathers the shards in bf16 (its
    mixed-precision dtype, the storage's own) and DeepSpeed holds every parameter in bf16, where ddp autocasts from
    float32: their losses differ by bf16 arithmetic, never by a rewritten base (that one is above 2.3)."""
    for ours, theirs in zip(runs[strategy, "llama"]["qlora_bf16"], runs["ld_ddp", "llama"]["qlora_bf16"]):
        assert ours["losses"] == pytest.approx(theirs["losses"], rel=2e-3 if cpu_has_bf16() else 5e-3)
        assert ours["quantized_bytes_held"] * 2 == theirs["quantized_bytes_held"]
        assert ours["base_unchanged"] and ours["adapters_changed"]


@pytest.mark.parametrize("strategy,place,refusal", [
    # Built in __init__: refused before any rank starts.
    ("ld_fsdp", "qlora_uint8",
     "ld_fsdp: model.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight is a bitsandbytes 4-bit"
     " weight stored as torch.uint8, which this strategy would shard as numbers and train silently wrong (accelerate"
     " #3983); it shards 4-bit weights stored as floats: load the base with BitsAndBytesConfig(load_in_4bit=True,"
     " bnb_4bit_quant_storage=torch.bfloat16), or train it under ld_ddp"),
    # Built in configure_model: at each rank's set-up.
    ("ld_fsdp_tp", "qlora_configure_model",
     "ld_fsdp: model.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight is a bitsandbytes 4-bit"
     " weight stored as torch.float32, which lightning-dist shards over data-parallel ranks only, not with"
     " strategy.tensor_parallel_size=2: train it with those sizes at 1, or under ld_ddp"),
])
def test_a_4_bit_base_is_refused_in_one_line_where_it_would_be_rewritten(pretrained_folders, tmp_path, strategy,
                                                                         place, refusal):
    """FSDP2 cannot shard uint8 bytes, and tensor parallelism splits a weight along rows or columns its packed bytes
    do not have (accelerate #3983; bitsandbytes #1945: trained to 0 or NaN)."""
    process = subprocess.run(
        [sys.executable, str(REPO / "tests" / "finetune_script.py"), str(tmp_path), str(pretrained_folders["llama"]),
         strategy, place, "2"],
        cwd=tmp_path, env={**TRAIN_ENV, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert process.returncode != 0
    lines = process.stderr.splitlines()
    assert any(line.endswith(refusal) for line in lines), process.stderr[-3000:]
    launched = any(line.startswith("[rank") for line in lines)
    assert launched == (place == "qlora_configure_model")
    assert not list(tmp_path.glob("*.json"))  # nothing trained


def resumed(pretrained_folders, out, adapters, strategy: str, ranks: int) -> list[dict]:
    out.mkdir()
    process = subprocess.run(
        [sys.executable, str(REPO / "tests" / "finetune_script.py"), str(out), str(pretrained_folders["llama"]),
         strategy, f"resume={adapters}", str(ranks)],
        cwd=out, env={**TRAIN_ENV, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=900)
    assert process.returncode == 0, process.stderr[-4000:]
    return [json.loads((out / f"resume.rank{rank}.json").read_text()) for rank in range(ranks)]


def test_adapters_written_under_fsdp_resume_at_another_world_size_and_strategy(runs, pretrained_folders, tmp_path):
    """The adapters 2 fsdp ranks wrote (save_adapters), loaded by PEFT's own `PeftModel.from_pretrained` in
    `configure_model`, train on from their saved values on 1 ddp rank, 2 tensor-parallel ranks and 2 ZeRO-3 ranks.
    Before, every preset that builds the model on the meta device started the loaded adapters again from LoRA's
    B = 0 (largest |B| at the start 0.0, not the saved 0.003), silently."""
    from peft import PeftModel
    from safetensors.torch import load_file

    import lightning_dist

    adapters = runs["ld_fsdp", "llama"]["out"] / "adapters-ld_fsdp"
    saved_b = max(t.abs().max().item() for n, t in load_file(adapters / "adapter_model.safetensors").items()
                  if "lora_B" in n)
    assert saved_b > 0
    layouts = {"ld_ddp@1": ("ld_ddp", 1), "ld_fsdp_tp": ("ld_fsdp_tp", 2),
               "ld_deepspeed_stage_3": ("ld_deepspeed_stage_3", 2)}
    results = {name: resumed(pretrained_folders, tmp_path / name.replace("@", "-"), adapters, *layout)
               for name, layout in layouts.items()}
    for result in (r for rank_results in results.values() for r in rank_results):
        assert result["lora_b_start_max"] == pytest.approx(saved_b, rel=1e-6)
        assert result["base_unchanged"] and result["adapters_changed"]
    (one_rank,) = results["ld_ddp@1"]
    assert step_losses("ld_fsdp_tp", results["ld_fsdp_tp"]) == pytest.approx(one_rank["losses"], rel=1e-5)
    model = PeftModel.from_pretrained(lightning_dist.from_pretrained(pretrained_folders["llama"]), adapters)
    for result in [one_rank, *results["ld_deepspeed_stage_3"]]:  # data parallel: each rank its own batch
        ids = torch.tensor(result["first_batch"])
        with torch.no_grad():
            assert result["losses"][0] == pytest.approx(model(input_ids=ids, labels=ids).loss.item(), rel=1e-5)
