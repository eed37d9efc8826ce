"""Bad input gets one line that names the key and the valid choices, before any rank is spawned."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from lightning_dist.run.compose import build
from lightning_dist.run.config_check import ConfigError, check_overrides
from tests.conftest import CONF_DIR, PRESET_NAMES, REPO


def error_of(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as error:
        check_overrides(overrides)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_unknown_strategy_lists_every_option():
    options = ", ".join(sorted([*PRESET_NAMES, "auto_fit", "deepspeed"]))
    assert error_of(["strategy=fsdp_zero9"]) == f"strategy=fsdp_zero9: no such option; choose one of: {options}"


def test_unknown_option_inside_a_sweep():
    assert error_of(["strategy=ddp,fdsp"]).startswith(
        "strategy=fdsp: no such option; did you mean fsdp? choose one of: auto_fit, ddp, deepspeed,"
    )


@pytest.mark.parametrize(("override", "hint"), [
    ("trainer=ddp", "lightning-hydra-template's trainer=ddp is strategy=ddp trainer=gpu here; "),
    ("trainer=ddp_sim", "lightning-hydra-template's trainer=ddp_sim is strategy=ddp trainer=cpu trainer.devices=2 here; "),
    ("trainer=fsdp", "fsdp is a strategy option (strategy=fsdp); "),
    ("strategy=gpu", "gpu is a trainer option (trainer=gpu); "),
    ("trainer=mps", ""),
])
def test_a_template_users_trainer_or_another_groups_option_says_where_it_is(override, hint):
    group = override.split("=")[0]
    assert error_of([override]).startswith(f"{override}: no such option; {hint}choose one of: ")
    assert error_of([override]).endswith(", ".join(sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))))


def test_a_recipes_config_directory_adds_its_options():
    search = f"hydra.searchpath=[file://{REPO / 'recipes' / 'choose_a_strategy' / 'conf'}]"
    assert error_of([search, "model=gpt_7c"]) == (
        "model=gpt_7c: no such option; did you mean gpt_7b? choose one of: gpt_70b, gpt_7b, gpt_medium, gpt_moe,"
        " gpt_small, gpt_tiny, hf_bart, hf_gpt2, hf_llama, hf_mixtral"
    )
    assert error_of(["model=hf_bart", "model.confg.d_model=8"]).startswith(
        "model.confg: no such key; did you mean model.config? valid keys under model: optimizer, _target_, block_class, model_type,"
    )
    assert check_overrides(["model=hf_bart"]).model.config.encoder_layers == 2


def test_a_hugging_face_model_without_its_extra_names_the_extra(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find_spec(name, *a))
    assert error_of(["model=hf_llama", "+lora=default"]) == (
        'lora=default: needs peft, not installed here; pip install -e ".[hf]"')


def test_misspelled_key_suggests_the_real_one():
    message = error_of(["trainer.max_stepz=20"])
    assert message.startswith("trainer.max_stepz: no such key; did you mean trainer.max_steps? valid keys under trainer:")
    assert "accumulate_grad_batches" in message


def test_misspelled_key_of_the_chosen_strategy():
    message = error_of(["strategy=deepspeed_stage_2", "strategy.offload_optimiser=cpu"])
    assert message.startswith("strategy.offload_optimiser: no such key; did you mean strategy.offload_optimizer?")


def test_misspelled_top_level_and_nested_group():
    assert error_of(["sed=1"]).startswith("sed: no such key; did you mean seed? valid keys at the top level:")
    assert error_of(["trainr.devices=2"]).startswith("trainr: no such key; did you mean trainer?")


def test_valid_overrides_compose_once(monkeypatch):
    from lightning_dist.run import config_check

    composed = []
    monkeypatch.setattr(config_check, "compose", lambda *a, **k: composed.append(k["overrides"]) or compose(*a, **k))
    overrides = ["strategy=fsdp", "trainer.max_steps=20", "+trainer.fast_dev_run=true"]
    cfg = check_overrides(overrides)
    assert cfg.strategy.sharding_strategy == "FULL_SHARD" and cfg.trainer.max_steps == 20
    assert composed == [overrides]  # each rank's start composes it twice more, in Hydra: a quarter of a second each


def build_error(overrides: list[str]) -> str:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().set_config(cfg)
    with pytest.raises(ConfigError) as error:
        build(cfg)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_parameter_offload_with_stage_2():
    assert build_error(["strategy=deepspeed_stage_2", "strategy.offload_parameters=cpu"]) == (
        "strategy.offload_parameters: parameter offload needs ZeRO stage 3, got strategy.stage=2;"
        " choose strategy.stage=3 or strategy.offload_parameters=null"
    )


def test_block_class_that_does_not_exist():
    message = build_error(["strategy=fsdp", "model.block_class=lightning_dist.models.gpt.Block"])
    assert message.startswith("model.block_class: 'lightning_dist.models.gpt.Block' is not an nn.Module class;")
    assert "TransformerBlock" in message


def test_block_class_that_is_not_in_the_model():
    message = build_error(["strategy=fsdp", "model.block_class=torch.nn.Conv2d"])
    assert message.startswith("model.block_class: the model has no Conv2d module; classes in the model:")


def write_inputs(directory: Path) -> None:
    """Files the refused commands point at: not checkpoints, another model's checkpoint, bad DeepSpeed configs."""
    import torch

    from lightning_dist.models.gpt import GPTLanguageModel

    directory.mkdir()
    torch.save({"model": {}}, directory / "weights.pt")  # a torch file, but no Lightning checkpoint
    model = GPTLanguageModel(vocab_size=256, block_size=128, n_layer=4, n_head=4, d_model=128)  # gpt_tiny's shapes
    torch.save({"state_dict": model.state_dict(), "global_step": 0}, directory / "gpt_tiny.ckpt")
    (directory / "misspelt.json").write_text('{"train_micro_batch_size_per_gpu": "auto", "zero_optimisation": {"stage": 2}}')
    (directory / "deep.json").write_text('{"a": ' * 10_000 + "1" + "}" * 10_000)
    (directory / "conf" / "trainer").mkdir(parents=True)  # lightning-hydra-template's trainer/ddp.yaml, in short
    (directory / "conf" / "trainer" / "ddp.yaml").write_text("defaults:\n  - default\nstrategy: ddp\n")


SYS = "/sys/lightning_dist"  # not writable, even for root
CORES = len(os.sched_getaffinity(0))
REFUSED = [
    (["strategy=nope"], "strategy=nope: no such option; choose one of:"),
    (["strategy=deepspeed_stage3"], "strategy=deepspeed_stage3: no such option; did you mean deepspeed_stage_3? choose"
     " one of: auto_fit, ddp,"),
    (["trainer.devices=0"], 'trainer.devices=0: must be an integer >= 1 (devices per node), -1 (every one), "auto", or'
     " device indices ([0, 1])"),
    (["trainer.devices=-2"], "trainer.devices=-2: must be an integer >= 1 (devices per node)"),
    # This machine has no GPU (CI's neither): said before Lightning's "No supported gpu backend found!".
    (["trainer=gpu"], "trainer.accelerator=gpu: this machine has no NVIDIA GPU (no driver device in /dev); train on its"
     " CPU with trainer=cpu, or check the GPU run without one with dry_run=true"),
    (["strategy=deepspeed_stage_2", "strategy.offload_parameters=cpu"],
     "strategy.offload_parameters: parameter offload needs ZeRO stage 3"),
    (["strategy=fsdp", "optimizer=adafactor"],
     "model.optimizer: Adafactor needs each parameter whole and fsdp shards them; choose optimizer=adamw"),
    (["strategy=deepspeed_stage_2", "optimizer=adafactor"],
     "model.optimizer: Adafactor needs each parameter whole and ZeRO stage 2 shards them;"),
    # Values that used to start every rank, each of which then failed with its own traceback.
    (["trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches=0: must be an integer >= 1"),
    (["trainer.val_check_interval=0"], "trainer.val_check_interval=0: must be null, an integer >= 1 (training batches)"),
    (["data.batch_size=0"], "data.batch_size=0: must be an integer >= 1"),
    (["model.optimizer.lr=-1"], "model.optimizer.lr=-1: must be a number > 0"),
    (["model.optimizer.lr=abc"], "model.optimizer.lr=abc: must be a number > 0"),
    (["resume=yes"], "resume=yes: must be true, false or run_dir (the newest whole checkpoint in hydra.run.dir only:"),
    (["trainer.max_steps=${oc.env:HOME}"], "trainer.max_steps=${oc.env:HOME} (= "),
    (["model.d_model=256", "ckpt_path={inputs}/gpt_tiny.ckpt"],
     "ckpt_path: {inputs}/gpt_tiny.ckpt holds another model's weights: 69 have other shapes (e.g."
     " model.token_embedding.weight is [256, 128] there and [256, 256] in this model)"),
    (["callbacks.model_checkpoint.dirpath=" + SYS], f"callbacks.model_checkpoint.dirpath: cannot write checkpoints to {SYS} (/sys: "),
    # Tensor parallelism: sizes that do not fit the ranks or a node, a layer or heads the size cannot split, a style
    # that does not exist.
    (["strategy=fsdp_tp", "strategy.tensor_parallel_size=3"], "strategy.tensor_parallel_size=3: the run's 2 ranks"
     " (trainer.devices x trainer.num_nodes) do not divide into groups of these sizes"),
    (["strategy=fsdp_tp", "strategy.tensor_parallel_size=3", "trainer.devices=4"], "strategy.tensor_parallel_size=3:"
     " the run's 4 ranks (trainer.devices x trainer.num_nodes) do not divide into groups of these sizes"),
    (["strategy=hsdp_tp", "strategy.data_parallel_replicate_size=0"],
     "strategy.data_parallel_replicate_size=0: must be null, an integer >= 1, or -1 (the ranks that are left)"),
    (["strategy=fsdp_tp", "trainer.num_nodes=2", "strategy.tensor_parallel_size=4"], "strategy.tensor_parallel_size=4:"
     " tensor parallelism splits each layer over ranks of one node, and a node runs 2 (trainer.devices)"),
    (["strategy=fsdp_tp", "model.n_head=1"], "strategy.tensor_parallel_size=2: model.blocks.0.attn.q has 1 attention"
     " head(s), which 2 ranks do not split evenly (and 11 more layers)"),
    # transformers' Mixtral keeps its experts fused: a plan naming them names parameters (transformers 5.24's own
    # did; 5.25's splits the attention only, which trains: fsdp_tp's losses on 2 ranks equal ddp's on one); the line
    # says what to type instead.
    (["model=hf_mixtral", "strategy=fsdp_tp", "strategy.tensor_parallel_plan={model.model.layers.*.self_attn.o_proj:"
      "rowwise,model.model.layers.*.mlp.experts.down_proj:rowwise}"],
     "strategy.tensor_parallel_plan: model.model.layers.*.mlp.experts.down_proj names a parameter of MixtralExperts"
     " (its experts fused in one tensor), not a layer: tensor parallelism here splits nn.Linear layers; set"
     " strategy.tensor_parallel_plan to the plan without the experts ({model.model.layers.*.self_attn.o_proj:"
     "rowwise}), or train the model under fsdp"),
    # OLMo2's own plan gathers its attention's projections whole (its q and k norms span every head), which fsdp_tp
    # runs and DeepSpeed AutoTP's name rules do not: its runs failed in a traceback from inside its forward.
    (["model=hf_llama", "model.model_type=olmo2", "strategy=deepspeed_stage_2", "strategy.tensor_parallel_size=2"],
     "strategy.tensor_parallel_size=2: Olmo2ForCausalLM.tp_plan splits layers in colwise_gather_output,"
     " rowwise_split_input, which DeepSpeed AutoTP's name rules do not do (it reads no plan from a LightningModule);"
     " train it under strategy=fsdp_tp"),
    # BLOOM's positions are ALiBi slopes in its attention: nothing gives a shard its own (its runs stopped in the
    # first step, in a traceback on every rank)
    (["model=hf_llama", "model.model_type=bloom", "strategy=fsdp", "strategy.context_parallel_size=2"],
     "strategy.context_parallel_size=2: HFLanguageModel has no position embedding (position_embedding, wpe,"
     " embed_positions) or rotary table to give each shard its positions (ALiBi models, such as BLOOM, have none)"),
    # Attention that is not F.scaled_dot_product_attention, which the exchange goes around: GPT-OSS's (its sinks: eager
    # only), and a model loaded with attn_implementation="eager" (each stopped in its first step, after loading)
    (["model=hf_mixtral", "model.model_type=gpt_oss", "strategy=fsdp", "strategy.context_parallel_size=2"],
     "strategy.context_parallel_size=2: GptOssForCausalLM has no scaled_dot_product_attention implementation in"
     " transformers (it runs eager attention), and context parallelism exchanges that function's inputs across the"
     " ranks; train it without context parallelism"),
    (["model=hf_llama", "+model.config.attn_implementation=eager", "strategy=deepspeed_stage_2",
      "strategy.context_parallel_size=2"],
     "strategy.context_parallel_size=2: LlamaForCausalLM attends with attn_implementation=\"eager\"; context"
     " parallelism exchanges scaled_dot_product_attention's inputs across the ranks: load it with"
     " attn_implementation=\"sdpa\""),
    # A mixture of experts' load-balancing loss reads every layer's routers at once (every rank stopped in the first
    # step, in a traceback)
    (["model=hf_mixtral", "strategy=fsdp_pp"],
     "strategy.pipeline_parallel_size=2: MixtralForCausalLM adds its routers' load-balancing loss"
     " (model.config.output_router_logits=true), made from every layer's routers at once, which pipeline stages hold"
     " apart; set it false to train without it, or split the experts instead (strategy=fsdp"
     " strategy.expert_parallel_size=2)"),
    (["model=hf_gpt2", "strategy=fsdp_tp"],
     "strategy.tensor_parallel_size=2: HFLanguageModel has no tensor-parallel plan (a `tp_plan` attribute); set"
     " strategy.tensor_parallel_plan"),
    (["strategy=fsdp_tp", "strategy.tensor_parallel_plan={blocks.*.attn.q:diagonal}"],
     "strategy.tensor_parallel_plan.blocks.*.attn.q=diagonal: no such style; choose one of: colwise, rowwise"),
    # Pipeline parallelism: a schedule torch does not ship, blocks that do not divide into stages, a stage count or a
    # microbatch count the schedule refuses, a batch that does not divide into microbatches, sizes the ranks refuse.
    (["strategy=fsdp_pp", "trainer.devices=4", "strategy.pipeline_schedule=ZBV"], "strategy.pipeline_schedule='ZBV':"
     " choose one of GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV, or a"
     " schedule's .csv file"),
    (["strategy=fsdp_pp", "trainer.devices=3", "strategy.pipeline_parallel_size=3"], "strategy.pipeline_parallel_size=3:"
     " the model's 4 blocks do not divide into 3 stages (pipeline_parallel_size x stages_per_rank=1)"),
    (["strategy=fsdp_pp", "trainer.devices=4", "strategy.pipeline_schedule=ZBVZeroBubble"],
     "strategy.stages_per_rank=1: ZBVZeroBubble runs exactly 2 stage(s) per rank"),
    (["strategy=fsdp_pp", "trainer.devices=4", "strategy.pipeline_schedule=/nonexistent/schedule.csv"],
     "strategy.pipeline_schedule=/nonexistent/schedule.csv: cannot be read (No such file or directory)"),
    (["strategy=fsdp_pp", "trainer.devices=4", "strategy.microbatches=1"], "strategy.microbatches=1: 1F1B needs at"
     " least one per stage, here 2 (pipeline_parallel_size x stages_per_rank)"),
    (["strategy=fsdp_pp", "trainer.devices=4", "strategy.pipeline_schedule=Interleaved1F1B", "strategy.stages_per_rank=2",
      "strategy.microbatches=5", "model.n_layer=8"], "strategy.microbatches=5: Interleaved1F1B runs them in rounds of"
     " about pipeline_parallel_size=2 and needs whole rounds; choose one of 1, 2, 3, 4, 6, 8, ..."),
    (["strategy=fsdp_pp", "trainer.devices=4", "strategy.microbatches=3"], "strategy.microbatches=3: data.batch_size=16"
     " (per data-parallel rank) does not divide into them; choose a divisor of the batch"),
    (["strategy=fsdp_pp", "trainer.devices=3"], "strategy.pipeline_parallel_size=2, strategy.tensor_parallel_size=1:"
     " the run's 3 ranks (trainer.devices x trainer.num_nodes) do not divide into groups of these sizes"),
    (["strategy=fsdp_tp_pp", "trainer.devices=4", "strategy.pipeline_parallel_size=4"],
     "strategy.pipeline_parallel_size=4, strategy.tensor_parallel_size=2: the run's 4 ranks (trainer.devices x"
     " trainer.num_nodes) do not divide into groups of these sizes"),
    (["strategy=fsdp", "trainer.devices=6", "strategy.context_parallel_size=3"], "strategy.context_parallel_size=3:"
     " all_to_all gives each rank 4/3 of the model's 4 attention heads (model.n_head); choose one of 1, 2"),
    (["strategy=fsdp_tp", "trainer.devices=8", "strategy.context_parallel_size=4"], "strategy.context_parallel_size=4:"
     " all_to_all gives each rank 4/(2 x 4) of the model's 4 attention heads (model.n_head); choose tensor- and"
     " context-parallel sizes whose product divides 4"),
    (["strategy=fsdp", "trainer.devices=4", "strategy.context_parallel_size=0"], "strategy.context_parallel_size=0: give"
     " a whole number of ranks, at least 1"),
    (["strategy=deepspeed_stage_2", "trainer.devices=6", "strategy.context_parallel_size=3"],
     "strategy.context_parallel_size=3: all_to_all gives each rank 4/3 of the model's 4 attention heads (model.n_head);"
     " choose one of 1, 2"),
    # Each size suggested passes the heads' check too (3 and 6 split the GPT's 4 heads unevenly).
    (["strategy=deepspeed_stage_2", "trainer.devices=6", "strategy.context_parallel_size=4"],
     "strategy.context_parallel_size=4: the 6 ranks do not divide into sequence-parallel groups of that size; choose"
     " one of 1, 2"),
    (["strategy=deepspeed_stage_3", "trainer.devices=3", "strategy.context_parallel_size=3"],
     "strategy.context_parallel_size=3: all_to_all gives each rank 4/3 of the model's 4 attention heads (model.n_head);"
     " choose one of 1"),
    (["strategy=fsdp", "trainer.devices=4", "strategy.context_parallel_size=2", "data.block_size=130"],
     "strategy.context_parallel_size=2: a sequence of 130 tokens (data.block_size) does not split into 2 x 2 equal"
     " chunks; choose a size or a length that does"),
    (["strategy=fsdp", "trainer.devices=4", "strategy.context_parallel_size=2", "strategy.context_parallel=ring"],
     "strategy.context_parallel=ring: not available on CPU: torch's SDPA for CPU has no rule in its context-parallel"
     " API; choose all_to_all (Ulysses), which runs everywhere"),
    (["strategy=fsdp", "trainer.devices=4", "strategy.context_parallel_size=2", "strategy.context_parallel=ulysses"],
     "strategy.context_parallel='ulysses': choose one of all_to_all, ring"),
    (["strategy=fsdp", "trainer.devices=6", "strategy.context_parallel_size=4"], "strategy.context_parallel_size=4:"
     " the 6 ranks do not divide into sequence-parallel groups of that size; choose one of 1, 2"),
    (["strategy=fsdp_pp", "trainer.devices=4", "dry_run=true", "strategy.pipeline_schedule=ZBVZeroBubble",
      "strategy.stages_per_rank=2"], "dry_run=true: strategy.pipeline_schedule=ZBVZeroBubble is not dry-run"
     " (zero-bubble and file schedules split backward in passes the dry run does not replay); GPipe, 1F1B,"
     " Interleaved1F1B, LoopedBFS are"),
    # What a strategy cannot combine, refused from the config before torch loads (QUIET_REFUSALS below).
    (["checkpoint.async=true", "strategy=deepspeed_stage_2"], "checkpoint.async=true: DeepSpeed's engine writes its"
     " checkpoints itself, synchronously, and has no hook to stage them;"),
    (["strategy=deepspeed_stage_3", "strategy.exclude_frozen_parameters=true", "strategy.tensor_parallel_size=2"],
     "strategy.exclude_frozen_parameters=true with strategy.tensor_parallel_size=2: each rank holds part of the model"
     " there, and a resume could not check the frozen parts it takes from the model; save them (false), or train"
     " without that split"),
    (["strategy=fsdp_pp", "strategy.exclude_frozen_parameters=true"], "strategy.exclude_frozen_parameters=true with"
     " strategy.pipeline_parallel_size=2: each rank holds part of the model there"),
    (["strategy.activation_checkpointing=ops", "strategy=deepspeed_stage_3"], "strategy.activation_checkpointing=ops:"
     " ZeRO-3 gathers and frees parameters inside each block, which op-level checkpointing cannot replay; use true"
     " (every block) or an integer k (every k-th block)"),
    (["dry_run=true", "trainer.devices=100000"], "dry_run=true: 100000 ranks (trainer.devices x trainer.num_nodes);"
     " the dry run steps its ranks in this process, up to 1024. For a larger world, plan=true says what each rank holds"),
    # DeepSpeed AutoTP: a size that does not divide the ranks, one that is no size, one the file contradicts.
    (["strategy=deepspeed_stage_2", "strategy.tensor_parallel_size=3"], "strategy: 1 problem: strategy.tensor_parallel_size=3:"
     " the 2 ranks do not divide into tensor-parallel groups of that size; choose one of 1, 2"),
    (["strategy=deepspeed_stage_1", "strategy.tensor_parallel_size=0"], "strategy.tensor_parallel_size=0: must be null"
     " (DeepSpeed: the config file's), an integer >= 1, or -1 (the ranks that are left)"),
    (["strategy=deepspeed", f"strategy.config={REPO}/tests/strategies/deepspeed/config/configs/llama_factory_ds_z2_autotp_config.json",
      "strategy.tensor_parallel_size=1"], "strategy.config (llama_factory_ds_z2_autotp_config.json): 1 problem:"
     " tensor_parallel.autotp_size=2 but strategy.tensor_parallel_size=1 (make them agree)"),
    # Overrides Hydra cannot parse, as a shell passes them unquoted.
    (["ckpt_path=/tmp/my", "dir/x"], "dir/x: not an override (key=value); if it is the rest of ckpt_path=/tmp/my after a"
                                     " space, quote the whole value: \"ckpt_path='/tmp/my dir/x'\""),
    (["ckpt_path=/tmp/ü"], "ckpt_path=/tmp/ü: Hydra cannot parse this override (a character it takes only inside quotes);"),
    (["seed=!!int", "3"], "seed=!!int: Hydra cannot parse this override"),
    (["ckpt_path=$(whoami)"], "ckpt_path=$(whoami): Hydra cannot parse this override (mismatched input '(' expecting"),
    # What used to end in a traceback before launch, or a message that said something else.
    (["logger=null"], "logger=null: a config group takes one of its options: csv, many_loggers, mlflow, tensorboard,"
                      " wandb; ~logger leaves it out"),
    (["~strategy"], "~strategy: every run needs a strategy; choose one of: auto_fit, ddp, deepspeed,"),
    # lightning-hydra-template's habit: the strategy as a Trainer argument. It trained ddp without a word.
    (["+trainer.strategy=fsdp"], "trainer.strategy=fsdp: the Trainer is given its strategy from the strategy group, in"
                                 " this key's place; choose strategy=..., one of: auto_fit, ddp, deepspeed,"),
    (["hydra.searchpath=[file://{inputs}/conf]", "trainer=ddp"], "trainer.strategy=ddp: the Trainer is given its"
                                                                  " strategy from the strategy group"),
    (["+trainer.logger=false"], "trainer.logger=false: the Trainer is given its logger from the logger group, in this"
                                " key's place; choose logger=..., one of: csv, many_loggers, mlflow, tensorboard, wandb;"
                                " ~logger for none"),
    (["trainer.devices=100"], f"trainer.devices=100: 100 CPU ranks on a node with {CORES} cores; each is a process"
     f" of its own, so at most {8 * CORES} here (8 per core); choose fewer, or check a larger world without training"
     " with dry_run=true"),
    # What `ckpt_path=$CKPT` gives with CKPT unset used to train from scratch without a word; a number, a traceback.
    (["ckpt_path="], "ckpt_path='': must be a checkpoint's path (a file or a directory), or null to train from"
     " scratch; empty is what `ckpt_path=$VAR` gives with VAR unset"),
    (["ckpt_path=123"], "ckpt_path=123: must be a checkpoint's path (a file or a directory), or null"),
    (["ckpt_path=/etc/passwd"], "ckpt_path: /etc/passwd is not a checkpoint: torch.save writes a zip archive"),
    (["ckpt_path={inputs}/weights.pt"], "ckpt_path: {inputs}/weights.pt is not a Lightning checkpoint: it holds no"
                                        " state_dict (it holds: model)"),
    (["paths.log_dir=" + SYS], f"hydra.run.dir: cannot write the run's directory {SYS}/train/runs/"),
    (["-m", "paths.log_dir=" + SYS, "seed=1,2"], f"hydra.sweep.dir: cannot write the sweep's directory {SYS}/train/multiruns/"),
    (["strategy=deepspeed", "strategy.config={inputs}/misspelt.json"],
     "strategy.config (misspelt.json): 1 problem: zero_optimisation: DeepSpeed 0.19.8 reads no such top-level key"
     " (it would ignore the section); did you mean zero_optimization?"),
    (["strategy=deepspeed", "strategy.config={inputs}/deep.json"],
     "strategy.config: {inputs}/deep.json nests deeper than 32 levels"),
    (["model=gpt_moe", "model.top_k=9"], "model.top_k=9: choose from 1 to model.n_experts=8"),
    (["model=hf_mixtral", "strategy=deepspeed_stage_3", "strategy.expert_parallel_size=2", "dry_run=true"],
     "dry_run=true: strategy.expert_parallel_size=2: DeepSpeed's AutoEP is not dry-run yet (FSDP's expert parallelism"
     " is: strategy=fsdp); plan=true gives its memory"),
    # lightning-hydra-template's flags: `train=false` tests ckpt_path without fitting.
    (["train=false", "test=false"], "train=false and test=false: nothing to run; train=false test=true"
     " ckpt_path=CHECKPOINT tests a checkpoint"),
    (["train=no"], "train=no: must be true or false (false: test only, on ckpt_path's weights)"),
]


@pytest.mark.parametrize(("arguments", "expected"), REFUSED, ids=lambda value: " ".join(value) if isinstance(value, list) else "")
def test_a_bad_value_is_one_error_line_and_exit_2_before_any_rank_starts(arguments, expected, tmp_path):
    """Typed as a user types it, from a fresh working directory: nothing added to the command."""
    inputs, work = tmp_path / "inputs", tmp_path / "work"
    write_inputs(inputs)
    work.mkdir()
    process = subprocess.run([sys.executable, str(REPO / "train.py"), *(a.replace("{inputs}", str(inputs)) for a in arguments)],
                             cwd=work, capture_output=True, text=True, timeout=120)
    assert process.returncode == 2, process.stderr[-3000:]
    error_lines = [line for line in process.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and error_lines[0].startswith("error: " + expected.replace("{inputs}", str(inputs))), process.stderr
    assert "Traceback" not in process.stdout + process.stderr
    assert "Initializing distributed" not in process.stdout + process.stderr
    assert [path for path in work.rglob("*") if path.is_file()] == []  # nothing of the refused run


# Refusals the config alone decides: made before torch, Lightning or DeepSpeed load (seconds of imports), so that
# the refusal is the only line printed, in well under 2 s.
QUIET_REFUSALS = [arguments for arguments, _ in REFUSED if arguments[0] in (
    "checkpoint.async=true", "strategy.activation_checkpointing=ops", "dry_run=true", "trainer.devices=0",
    "strategy=deepspeed_stage3", "trainer=gpu", "ckpt_path=", "ckpt_path=123", "trainer.devices=100", "logger=null",
    "~strategy", "+trainer.strategy=fsdp", "+trainer.logger=false", "train=false", "train=no")] + [
    ["strategy=fsdp_tp", "strategy.tensor_parallel_size=3", "trainer.devices=4"],
    *(arguments for arguments, _ in REFUSED if arguments[0] in ("strategy=fsdp_pp", "strategy=fsdp_tp_pp")),
    ["strategy=hsdp_tp", "trainer.devices=4", "trainer.num_nodes=2", "strategy.data_parallel_replicate_size=3"]]


def test_refusals_the_config_decides_load_no_torch_and_print_nothing_else():
    probe = ("import sys, json\n"
             "from lightning_dist.run.config_check import ConfigError, check_overrides\n"
             "from lightning_dist.run.config_values import check_values\n"
             "said = []\n"
             "for arguments in json.loads(sys.argv[1]):\n"
             "    try:\n"
             "        check_values(check_overrides(arguments))\n"
             "    except ConfigError as error:\n"
             "        said.append(str(error))\n"
             "print(json.dumps({'said': said, 'loaded': sorted({'torch', 'lightning', 'deepspeed'} & set(sys.modules))}))\n")
    # -X importtime: a fresh interpreter (the suite's warm one has torch loaded already); its report goes to stderr.
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", probe, json.dumps(QUIET_REFUSALS)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["loaded"] == []
    assert len(report["said"]) == len(QUIET_REFUSALS)
    assert report["said"][-1] == ("strategy.tensor_parallel_size=2, strategy.data_parallel_replicate_size=3: the run's 8"
                                  " ranks (trainer.devices x trainer.num_nodes) do not divide into groups of these sizes")


def test_a_callback_or_logger_set_to_null_is_switched_off(tmp_path):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["callbacks.run_summary=null", "logger.csv=null", "trainer.devices=1",
                                          f"hydra.run.dir={tmp_path}"], return_hydra_config=True)
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().set_config(cfg)
    cfg.paths.output_dir = str(tmp_path)
    trainer = build(cfg)["trainer"]
    names = {type(c).__name__ for c in trainer.callbacks}
    assert "RunSummary" not in names and {"TrainingMonitor", "ModelCheckpoint"} <= names
    assert trainer.loggers == []


@pytest.mark.parametrize("accelerator", ["tpu", "mps"])
def test_an_accelerator_we_do_not_run_on_is_named_with_the_choices(accelerator):
    assert build_error([f"trainer.accelerator={accelerator}"]) == (
        f"trainer.accelerator={accelerator}: this package runs on CPU or CUDA; choose one of cpu, cuda, gpu, auto"
    )


def readme_mistakes() -> list[tuple[str, str]]:
    """(command, the error line docs/configuration.md shows for it) from its block of mistakes, as a user would copy
    them."""
    text = (REPO / "docs" / "configuration.md").read_text()
    block = text[text.index("Mistakes are reported in one line"):].split("```")[1]
    lines = [line for line in block.splitlines() if line.strip()]
    return [(lines[i].removeprefix("$ "), lines[i + 1]) for i in range(0, len(lines), 2)]


@pytest.mark.parametrize(("command", "shown"), readme_mistakes())
def test_the_readmes_mistakes_print_what_it_shows(command, shown, tmp_path):
    import shlex

    arguments = shlex.split(command)
    assert arguments[:2] == ["python", "train.py"]
    process = subprocess.run([sys.executable, str(REPO / "train.py"), *arguments[2:]], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
    assert process.returncode == 2
    assert process.stderr.splitlines()[-1].startswith(shown.removesuffix("..."))


def test_the_refusal_benchmark_times_each_refusal_where_it_is_decided(tmp_path):
    """benchmarks/refusal_times.py times the cases above in one process (each under 2 s, BENCHMARKS.md): each one it
    times is refused there with the line train.py prints, so that it times the refusal, not a run that went on."""
    from benchmarks.refusal_times import refusal

    inputs = tmp_path / "inputs"
    write_inputs(inputs)
    for arguments, expected in REFUSED:
        said = refusal([a.replace("{inputs}", str(inputs)) for a in arguments])
        assert said is not None, arguments
        if not expected.startswith("hydra."):  # the benchmark asks the directory check itself
            assert said.startswith(expected.replace("{inputs}", str(inputs))), (arguments, said)
