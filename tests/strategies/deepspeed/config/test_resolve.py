"""Filling "auto" and reporting contradictions, on the two real Hugging Face files and on small variations."""

import copy
import dataclasses
import json

import pytest

from lightning_dist.strategies.deepspeed.config import (
    FILLED_KEYS,
    UNKNOWN,
    DeepSpeedConfigError,
    OptimizerFacts,
    TrainingFacts,
    ZeroOptions,
    load_user_config,
    resolve,
    resolve_config,
)
from tests.conftest import HF_ZERO2 as ZERO2
from tests.conftest import HF_ZERO3 as ZERO3
from tests.conftest import REPO

FACTS = TrainingFacts(
    precision="bf16-mixed",
    world_size=2,
    accumulate_grad_batches=1,
    gradient_clip_val=None,
    gradient_clip_algorithm="norm",
    fp16_supported=False,
    device_type="cpu",
    micro_batch_size=8,
    optimizer=OptimizerFacts("AdamW", lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01),
    warmup_steps=0,
    total_steps=300,
    hidden_size=128,
)


def facts(**changes) -> TrainingFacts:
    return dataclasses.replace(FACTS, **changes)


from lightning_dist.strategies.deepspeed.config.resolve import auto_keys  # noqa: E402


def problems_of(config, run_facts=FACTS, options=ZeroOptions()) -> list[str]:
    with pytest.raises(DeepSpeedConfigError) as raised:
        resolve_config(config, run_facts, options)
    message = str(raised.value)
    assert "\n" not in message  # one line, all problems
    assert all(problem in message for problem in raised.value.problems)
    return raised.value.problems


def test_hf_zero2_file_every_auto_is_filled_from_the_run():
    config, source = load_user_config(ZERO2)
    assert source == "strategy.config (transformers_ds_config_zero2.json)"
    resolved = resolve_config(config, facts(gradient_clip_val=0.5, accumulate_grad_batches=2))
    assert auto_keys(resolved) == []
    assert resolved["train_micro_batch_size_per_gpu"] == 8
    assert resolved["gradient_accumulation_steps"] == 2
    assert resolved["train_batch_size"] == 8 * 2 * 2
    assert resolved["gradient_clipping"] == 0.5
    assert resolved["bf16"] == {"enabled": True} and resolved["fp16"]["enabled"] is False
    assert resolved["optimizer"] == {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}}
    assert resolved["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 1}
    assert config == json.loads(ZERO2.read_text())  # the user's dict is not modified


def test_hf_zero3_file_is_refused_by_deepspeeds_own_rules_before_launch():
    # Hugging Face's file predates DeepSpeed's `reduce_bucket_size > 0` rule: even on a GPU with fp16 it cannot run.
    problems = problems_of(json.loads(ZERO3.read_text()), facts(precision="16-mixed", fp16_supported=True))
    assert problems == ["zero_optimization.reduce_bucket_size=0: DeepSpeed 0.19.8 refuses it (Input should be greater than 0)"]


def test_keys_we_do_not_fill_pass_through_unchanged():
    original = json.loads(ZERO3.read_text())
    original["zero_optimization"]["reduce_bucket_size"] = 5e8
    resolved = resolve_config(original, facts(precision="16-mixed", fp16_supported=True))
    for key in ("sub_group_size", "reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_max_live_parameters",
                "stage3_max_reuse_distance", "stage3_gather_fp16_weights_on_model_save", "overlap_comm", "offload_param"):
        assert resolved["zero_optimization"][key] == original["zero_optimization"][key]
    assert resolved["fp16"] == original["fp16"]
    assert resolved["optimizer"] == original["optimizer"]  # explicit optimizer values are the file's choice
    assert resolved["scheduler"] == original["scheduler"]
    assert resolved["steps_per_print"] == 2000 and resolved["wall_clock_breakdown"] is False


@pytest.mark.parametrize("precision, fp16, bf16", [("32-true", False, False), ("bf16-mixed", False, True), ("bf16-true", False, True), ("16-mixed", True, False)])
def test_precision_auto_follows_the_trainer(precision, fp16, bf16):
    resolved = resolve_config(load_user_config(ZERO2)[0], facts(precision=precision, fp16_supported=True))
    assert (resolved["fp16"]["enabled"], resolved["bf16"]["enabled"]) == (fp16, bf16)


def test_absent_trainer_keys_are_added_and_absent_precision_blocks_only_when_needed():
    resolved = resolve_config({}, facts(precision="32-true", gradient_clip_val=1.0))
    assert resolved == {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0}
    assert resolve_config({}, facts(precision="bf16-true"))["bf16"] == {"enabled": True}


def test_bucket_sizes_follow_the_hidden_size_like_hugging_face():
    config = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                    "stage3_param_persistence_threshold": "auto"}}
    zero = resolve_config(config, FACTS)["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"], zero["stage3_param_persistence_threshold"]) == (128 * 128, int(0.9 * 128 * 128), 1280)


def test_unknown_facts_leave_auto_for_the_in_rank_pass():
    # Before spawning, the loader may not exist yet: nothing is reported, "auto" stays, and setup fills it.
    partial = facts(micro_batch_size=UNKNOWN, optimizer=UNKNOWN)
    resolved = resolve_config(load_user_config(ZERO2)[0], partial)
    assert sorted(auto_keys(resolved)) == sorted([
        "train_micro_batch_size_per_gpu", "train_batch_size", "optimizer.params.lr", "optimizer.params.betas",
        "optimizer.params.eps", "optimizer.params.weight_decay", "scheduler.params.warmup_max_lr",
    ])
    assert resolved["gradient_accumulation_steps"] == 1


def test_strategy_options_fill_what_the_file_leaves_open():
    resolved = resolve_config({"zero_optimization": {"overlap_comm": True}}, FACTS, ZeroOptions(stage=3, offload_optimizer="cpu"))
    assert resolved["zero_optimization"] == {"overlap_comm": True, "stage": 3, "offload_optimizer": {"device": "cpu"}}
    nvme = resolve_config({}, FACTS, ZeroOptions(stage=3, offload_parameters="nvme", nvme_path="/x"))
    assert nvme["zero_optimization"]["offload_param"] == {"device": "nvme", "nvme_path": "/x"}


# Each case: a change to a config (or to the run) and every key the report must name.
MISMATCHES = {
    "micro batch vs loader": ({"train_micro_batch_size_per_gpu": 4}, {}, ["train_micro_batch_size_per_gpu=4 but the train loader's batch size is 8"]),
    "accumulation": ({"gradient_accumulation_steps": 2}, {"accumulate_grad_batches": 4}, ["gradient_accumulation_steps=2 but trainer.accumulate_grad_batches=4"]),
    "clipping vs other clipping": ({"gradient_clipping": 1.0}, {"gradient_clip_val": 0.5}, ["gradient_clipping=1 but trainer.gradient_clip_val=0.5"]),
    "clipping by value": ({}, {"gradient_clip_val": 0.5, "gradient_clip_algorithm": "value"}, ["trainer.gradient_clip_algorithm=value"]),
    "fp16 vs bf16-mixed": ({"fp16": {"enabled": True}}, {}, ["fp16.enabled=true but trainer.precision=bf16-mixed"]),
    "bf16 vs 16-mixed": ({"bf16": {"enabled": True}}, {"precision": "16-mixed", "fp16_supported": True}, ["bf16.enabled=true but trainer.precision=16-mixed"]),
    "file's fp16 on a CPU without it": ({"fp16": {"enabled": True}}, {"precision": "32-true"}, ['fp16.enabled=true: this CPU has no fp16 support in DeepSpeed (its CPU accelerator needs AVX512-FP16/AMX-FP16); set it to "auto" or false, or run on CUDA']),
    "fp16 off vs 16-mixed": ({"fp16": {"enabled": False}}, {"precision": "16-mixed", "fp16_supported": True}, ["fp16.enabled=false but trainer.precision=16-mixed"]),
    "fp16 on a CPU without it": ({"fp16": {"enabled": True}}, {"precision": "16-mixed"}, ["trainer.precision=16-mixed: this CPU has no fp16 support"]),
    "precision DeepSpeed has no mode for": ({}, {"precision": "64-true"}, ["trainer.precision=64-true: DeepSpeed trains in one of"]),
    "train_batch_size formula": ({"train_batch_size": 64}, {}, ["train_batch_size=64 but micro batch x accumulation x world size = 8 x 1 x 2 = 16"]),
    "betas from SGD": ({"optimizer": {"type": "AdamW", "params": {"betas": "auto"}}}, {"optimizer": OptimizerFacts("SGD", 0.1, None, None, 0.0)},
                       ['optimizer.params.betas="auto" cannot be filled: configure_optimizers returns SGD, which has no betas']),
    "lr with no module optimizer": ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, {"optimizer": None},
                                    ['optimizer.params.lr="auto" cannot be filled: LightningModule.configure_optimizers returns no optimizer']),
    "bucket size without a hidden size": ({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}, {"hidden_size": None},
                                          ['zero_optimization.reduce_bucket_size="auto" cannot be filled: they follow the model\'s hidden size']),
    "a tensor-parallel size that does not divide": ({"tensor_parallel": {"autotp_size": 3}}, {}, ["tensor_parallel.autotp_size=3: the 2 ranks do not divide into tensor-parallel groups of that size; choose one of 1, 2"]),
    "tensor parallel vs strategy.tensor_parallel_size": ({"tensor_parallel": {"autotp_size": 2}}, {}, ["tensor_parallel.autotp_size=2 but strategy.tensor_parallel_size=1 (make them agree)"]),
    "a sequence-parallel size that does not divide": ({"sequence_parallel_size": 3}, {"world_size": 4}, ["sequence_parallel_size=3: the 4 ranks do not divide into sequence-parallel groups of that size; choose one of 1, 2, 4"]),
    "sequence parallel vs strategy.context_parallel_size": ({"sequence_parallel_size": 2}, {"world_size": 4}, ["sequence_parallel_size=2 but strategy.context_parallel_size=4 (make them agree)"]),
    "sequence parallel beside AutoTP": ({"sequence_parallel_size": 2, "tensor_parallel": {"autotp_size": 2}}, {"world_size": 4}, ["sequence_parallel_size=2: DeepSpeed's AutoTP (tensor_parallel.autotp_size) does not run beside sequence parallelism here; choose one of the two"]),
    "train_batch_size under sequence parallelism": ({"sequence_parallel_size": 2, "train_batch_size": 32}, {"world_size": 4}, ["train_batch_size=32 but micro batch x accumulation x (world size / sequence_parallel_size) = 8 x 1 x 2 = 16"]),
    "an expert-parallel size that does not divide": ({"expert_parallel": {"enabled": True, "autoep_size": 3}, "zero_optimization": {"stage": 3}}, {"world_size": 4}, ["expert_parallel.autoep_size=3: the 4 ranks do not divide into expert-parallel groups of that size; choose one of 1, 2, 4"]),
    "expert parallel vs strategy.expert_parallel_size": ({"expert_parallel": {"enabled": True, "autoep_size": 2}, "zero_optimization": {"stage": 3}}, {"world_size": 4}, ["expert_parallel.autoep_size=2 but strategy.expert_parallel_size=4 (make them agree)"]),
    "expert parallel beside AutoTP": ({"expert_parallel": {"enabled": True, "autoep_size": 2}, "tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 3}}, {"world_size": 4}, ["expert_parallel.autoep_size=2: DeepSpeed's AutoTP (tensor_parallel.autotp_size) does not run beside expert parallelism here yet; choose one of the two"]),
    "expert parallel under ZeRO-2 with the module's optimizer": ({"expert_parallel": {"enabled": True, "autoep_size": 2}, "zero_optimization": {"stage": 2}}, {}, ["expert_parallel.autoep_size=2: DeepSpeed's ZeRO-2 steps AutoEP's experts only in parameter groups of their own, which the optimizer of configure_optimizers, built before AutoEP makes the experts, cannot have; use ZeRO-3 (strategy=deepspeed_stage_3), or an optimizer block in the DeepSpeed config (strategy.config), from which DeepSpeed builds them"]),
    "auto where we fill nothing": ({"steps_per_print": "auto"}, {}, ['steps_per_print="auto" is not a value we fill']),
    "stage vs strategy.stage": ({"zero_optimization": {"stage": 2}}, {}, ["zero_optimization.stage=2 but strategy.stage=3"]),
}


@pytest.mark.parametrize("case", MISMATCHES)
def test_each_mismatch_is_reported_by_key(case):
    change, fact_changes, expected = MISMATCHES[case]
    options = {"stage vs strategy.stage": ZeroOptions(stage=3),
               "tensor parallel vs strategy.tensor_parallel_size": ZeroOptions(tensor_parallel_size=1),
               "sequence parallel vs strategy.context_parallel_size": ZeroOptions(context_parallel_size=4),
               "expert parallel vs strategy.expert_parallel_size": ZeroOptions(expert_parallel_size=4),
               }.get(case, ZeroOptions())
    problems = problems_of(change, facts(**fact_changes), options)
    for fragment in expected:
        assert any(fragment in problem for problem in problems), (fragment, problems)
    assert len(problems) == len(expected)


def test_clipping_the_trainer_leaves_unset_comes_from_the_file_with_a_note():
    resolution = resolve({"gradient_clipping": 1.0}, facts(gradient_clip_val=None), source="strategy.config (ds.json)")
    assert resolution.config["gradient_clipping"] == 1.0 and resolution.trainer_settings == {}
    assert resolution.notes == ["gradient_clipping=1 comes from strategy.config (ds.json); the Trainer sets no gradient_clip_val"]
    assert resolve_config({"gradient_clipping": "auto"}, facts(gradient_clip_val=None))["gradient_clipping"] == 0.0


def test_a_misspelt_top_level_section_is_refused_with_the_real_name():
    # DeepSpeed itself would ignore it: the run would train with no ZeRO at all.
    problems = problems_of({"zero_optimisation": {"stage": 2}, "gradient_clipping": "auto"})
    assert problems == ["zero_optimisation: DeepSpeed 0.19.8 reads no such top-level key (it would ignore the section);"
                        " did you mean zero_optimization?"]


def test_another_tools_top_level_key_is_ignored_as_deepspeed_does_and_said():
    # LLaMA-Factory's public ds_z0_config.json carries both; DeepSpeed 0.19.8 reads neither.
    resolution = resolve({"comms_config": {"verbose": False}, "monitor_config": {"enabled": True}}, FACTS)
    assert resolution.config["comms_config"] == {"verbose": False}
    assert resolution.notes == [f"strategy.config: {key} is not a DeepSpeed 0.19.8 key; ignored, as DeepSpeed does"
                                for key in ("comms_config", "monitor_config")]


def test_every_top_level_key_deepspeed_documents_is_known():
    from lightning_dist._compat.deepspeed import top_level_config_keys

    documented = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
                  "scheduler", "fp16", "bf16", "amp", "gradient_clipping", "zero_optimization", "aio",
                  "activation_checkpointing", "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comms_logger",
                  "steps_per_print", "wall_clock_breakdown", "autotuning", "elasticity", "checkpoint",
                  "data_efficiency", "compression_training", "zero_allow_untested_optimizer", "tensor_parallel"}
    assert documented <= top_level_config_keys()


@pytest.mark.parametrize("key, precision", [("fp16", "16-mixed"), ("bf16", "bf16-mixed")])
def test_a_files_precision_decides_where_the_trainer_keeps_its_default(key, precision):
    config = {key: {"enabled": True, "loss_scale": 0}}
    resolution = resolve(config, facts(precision="32-true", fp16_supported=True), source="strategy.config (ds.json)")
    assert resolution.trainer_settings == {"precision": precision}
    assert resolution.notes == [f"trainer.precision={precision} comes from {key}.enabled=true in strategy.config (ds.json); the Trainer sets none"]
    assert resolution.config[key] == {"enabled": True, "loss_scale": 0}
    # An explicit Trainer precision is a choice too: two different ones are a mismatch (MISMATCHES).
    assert resolve(config, facts(precision="bf16-true", fp16_supported=True) if key == "bf16" else facts(precision="16-mixed", fp16_supported=True)).trainer_settings == {}


def test_a_files_accumulation_decides_where_the_trainer_accumulates_nothing():
    resolution = resolve({"gradient_accumulation_steps": 4, "train_batch_size": 64}, facts(accumulate_grad_batches=1))
    assert resolution.trainer_settings == {"accumulate_grad_batches": 4}
    assert resolution.config["train_batch_size"] == 64  # 8 x 4 x 2: checked against the file's accumulation
    assert resolution.notes == ["trainer.accumulate_grad_batches=4 comes from gradient_accumulation_steps=4 in strategy.config; the Trainer sets none"]


def test_all_problems_come_in_one_report():
    config = copy.deepcopy(json.loads(ZERO3.read_text()))
    config.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=3, gradient_clipping=2.0, train_batch_size=10)
    config["zero_optimization"]["offload_optimizer"]["device"] = "nvme"
    problems = problems_of(config, facts(gradient_clip_val=1.0, accumulate_grad_batches=2), ZeroOptions(stage=2, offload_optimizer="cpu"))
    keys = [problem.split("=")[0].split(":")[0] for problem in problems]
    assert keys == [
        "zero_optimization.stage", "zero_optimization.offload_optimizer.device", "zero_optimization.offload_optimizer.nvme_path",
        "fp16.enabled", "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps", "train_batch_size", "gradient_clipping", "zero_optimization.reduce_bucket_size",
    ]


def test_nvme_offload_in_the_file_needs_a_path_and_an_agreeing_one():
    config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}
    assert "zero_optimization.offload_param.nvme_path: NVMe offload needs a directory" in problems_of(config)[0]
    config["zero_optimization"]["offload_param"]["nvme_path"] = "/a"
    assert "nvme_path=\"/a\" but strategy.nvme_path=/b" in problems_of(config, FACTS, ZeroOptions(nvme_path="/b"))[0]


def test_every_filled_key_is_documented():
    page = (REPO / "docs" / "deepspeed-configs.md").read_text()
    assert [key for key in FILLED_KEYS if f"`{key}`" not in page] == []


@pytest.mark.parametrize("content, message", [
    (None, "is not a file"),
    ("{not json", "is not valid JSON (Expecting property name enclosed in double quotes at line 1, column 2)"),
    ("[1, 2]", "holds a JSON list; a DeepSpeed config is a JSON object"),
    ('{"a": ' * 40 + "1" + "}" * 40, "nests deeper than 32 levels; a DeepSpeed config has a few"),
    ('{"a": ' * 100_000 + "1" + "}" * 100_000, "nests deeper than 32 levels"),  # beyond Python's parser: RecursionError
])
def test_bad_config_files_get_one_line_errors(tmp_path, content, message):
    path = tmp_path / "ds.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises((ValueError, TypeError), match="^strategy.config: ") as raised:
        load_user_config(path)
    assert message in str(raised.value)


def test_ulysses_takes_the_strategys_size_or_the_files_and_counts_a_groups_ranks_once_in_the_batch():
    four_ranks = facts(world_size=4)
    resolved = resolve_config({"train_batch_size": "auto"}, four_ranks, ZeroOptions(context_parallel_size=2))
    assert resolved["sequence_parallel_size"] == 2 and resolved["train_batch_size"] == 16  # 8 x 1 x (4 / 2)
    from_file = resolve_config({"sequence_parallel_size": 2, "train_batch_size": "auto"}, four_ranks)
    assert from_file["sequence_parallel_size"] == 2 and from_file["train_batch_size"] == 16
    assert "sequence_parallel_size" not in resolve_config({}, four_ranks, ZeroOptions(context_parallel_size=1))
    assert resolve_config({"train_batch_size": "auto"}, four_ranks)["train_batch_size"] == 32


def test_deepspeed_autotp_takes_the_strategys_size_and_every_rank_when_it_is_minus_one():
    assert resolve_config({}, FACTS, ZeroOptions(tensor_parallel_size=2))["tensor_parallel"] == {"autotp_size": 2}
    assert resolve_config({}, FACTS, ZeroOptions(tensor_parallel_size=-1))["tensor_parallel"] == {"autotp_size": 2}
    assert resolve_config({"tensor_parallel": {"autotp_size": 2}}, FACTS)["tensor_parallel"] == {"autotp_size": 2}
    assert "tensor_parallel" not in resolve_config({}, FACTS)


def test_the_expert_parallel_option_turns_autoep_on_and_an_optimizer_block_lets_zero_2_run_it():
    section = resolve_config({"zero_optimization": {"stage": 3}}, facts(world_size=4),
                             ZeroOptions(expert_parallel_size=2))["expert_parallel"]
    assert section == {"enabled": True, "autoep_size": 2}
    with_optimizer = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    assert resolve_config(with_optimizer, facts(world_size=4), ZeroOptions(expert_parallel_size=2))["expert_parallel"]
    assert problems_of({"expert_parallel": {"enabled": False}}, facts(world_size=4),
                       ZeroOptions(expert_parallel_size=2)) == [
        "expert_parallel.enabled=false but strategy.expert_parallel_size=2 (make them agree)"]


def test_where_a_step_may_have_several_backwards_each_step_ends_the_accumulation():
    # Lightning ends each accumulation (the strategy's handles_gradient_accumulation is False), at an epoch's last batch
    # too; tests/strategies/deepspeed/test_manual_optimization.py trains under both rules.
    stage_2 = {"zero_optimization": {"stage": 2}}
    assert "managed_gradient_accumulation" not in resolve_config(stage_2, FACTS)  # one backward a step: DeepSpeed's
    assert resolve_config({**stage_2, "managed_gradient_accumulation": "auto"}, FACTS)["managed_gradient_accumulation"]
    for several in (facts(manual_optimization=True), facts(accumulate_grad_batches=4)):
        assert resolve_config(stage_2, several)["managed_gradient_accumulation"] is False
    assert problems_of({**stage_2, "managed_gradient_accumulation": True}, facts(manual_optimization=True)) == [
        "managed_gradient_accumulation=true but the module steps its optimizer itself (automatic_optimization=False): "
        'DeepSpeed\'s own count of backwards would end steps elsewhere (set it to "auto" or false)'
    ]
    assert problems_of({**stage_2, "managed_gradient_accumulation": True}, facts(accumulate_grad_batches=4)) == [
        "managed_gradient_accumulation=true but Lightning ends each accumulation of 4 batches, and at an epoch's last "
        'batch: DeepSpeed\'s own count of backwards would end steps elsewhere (set it to "auto" or false)'
    ]


def test_zero_1_overlaps_no_reduction_that_each_step_makes_and_says_so():
    zero_1 = {"zero_optimization": {"stage": 1, "overlap_comm": True}}
    resolution = resolve(zero_1, facts(accumulate_grad_batches=4))
    assert resolution.config["zero_optimization"]["overlap_comm"] is False
    assert resolution.notes == [
        "zero_optimization.overlap_comm=false: under managed_gradient_accumulation=false (Lightning ends each "
        "accumulation of 4 batches, and at an epoch's last batch) ZeRO-1 reduces the gradients in step(), with no "
        "backward to overlap"
    ]
    assert resolve_config(zero_1, FACTS)["zero_optimization"]["overlap_comm"] is True  # one backward a step
    zero_2 = {"zero_optimization": {"stage": 2, "overlap_comm": True}}
    assert resolve_config(zero_2, facts(accumulate_grad_batches=4))["zero_optimization"]["overlap_comm"] is True
