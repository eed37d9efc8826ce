"""Bad input gets one line that names the key and the valid choices, before any rank is spawned."""

import subprocess
import sys
import time

import pytest
from hydra import compose, initialize_config_dir

from lightning_dist.config_check import ConfigError, check_overrides
from lightning_dist.train import build
from tests.conftest import CONF_DIR, REPO, PRESET_NAMES


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
    assert error_of(["strategy=ddp,fdsp"]).startswith("strategy=fdsp: no such option; choose one of: auto_fit, ddp, deepspeed,")


def test_a_recipes_config_directory_adds_its_options():
    search = f"hydra.searchpath=[file://{REPO / 'recipes' / 'hf_causal_lm' / 'conf'}]"
    assert error_of([search, "model=hf_gpt3"]) == (
        "model=hf_gpt3: no such option; choose one of: gpt_medium, gpt_small, gpt_tiny, hf_bart, hf_gpt2, hf_llama"
    )
    assert error_of([search, "model=hf_bart", "model.confg.d_model=8"]).startswith(
        "model.confg: no such key; did you mean model.config? valid keys under model: optimizer, _target_, block_class, model_type,"
    )
    assert check_overrides([search, "model=hf_bart"]).model.config.encoder_layers == 2


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


def test_valid_overrides_compose():
    cfg = check_overrides(["strategy=fsdp", "trainer.max_steps=20", "+trainer.fast_dev_run=true"])
    assert cfg.strategy.sharding_strategy == "FULL_SHARD" and cfg.trainer.max_steps == 20


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


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["strategy=nope"], "error: strategy=nope: no such option; choose one of:"),
        (["strategy=deepspeed_stage_2", "strategy.offload_parameters=cpu"],
         "error: strategy.offload_parameters: parameter offload needs ZeRO stage 3"),
        (["strategy=fsdp", "optimizer=adafactor"],
         "error: model.optimizer: Adafactor needs each parameter whole and fsdp shards them; choose optimizer=adamw"),
        (["strategy=deepspeed_stage_2", "optimizer=adafactor"],
         "error: model.optimizer: Adafactor needs each parameter whole and ZeRO stage 2 shards them;"),
    ],
)
def test_command_line_prints_one_error_line_and_exits_2_without_spawning(overrides, expected, tmp_path):
    started = time.monotonic()
    process = subprocess.run(
        [sys.executable, "train.py", f"hydra.run.dir={tmp_path}", "trainer.devices=2", *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert process.returncode == 2
    error_lines = [line for line in process.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and error_lines[0].startswith(expected), process.stderr
    assert "Initializing distributed" not in process.stdout + process.stderr
    assert list(tmp_path.iterdir()) == []  # nothing of the refused run: the same directory takes the corrected one
    assert time.monotonic() - started < 60


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
