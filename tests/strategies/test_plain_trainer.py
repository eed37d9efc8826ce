"""Our strategies from a plain script with `L.Trainer(strategy=...)` and a LightningModule that is not ours."""

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from lightning_dist.strategies import PRESETS, REGISTRY_PREFIX
from tests.conftest import HF_ZERO2, REPO, in_the_suite

pytestmark = pytest.mark.slow


def run_script(*args: str, expect_returncode: int = 0) -> list[dict] | str:
    with tempfile.TemporaryDirectory() as out_dir:
        process = subprocess.run(
            [sys.executable, str(REPO / "tests" / "plain_trainer_script.py"), out_dir, *args],
            # Run where a user's script would: Lightning writes what it writes into the working directory.
            cwd=out_dir, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600,
        )
        assert process.returncode == expect_returncode, process.stderr[-4000:]
        # The script asked for no directory (no logger, no checkpoints): nothing of ours is written where it runs.
        assert not (Path(out_dir) / "deepspeed_config.effective.json").exists()
        if expect_returncode:
            return process.stderr
        # `import lightning_dist` silences the pinned libraries' warnings about their own code (ZeRO-3 printed 18
        # of torch's collective deprecations in 4 steps before), and leaves the script's own warnings be.
        assert "site-packages" not in "".join(each for each in process.stderr.splitlines(True) if "FutureWarning" in each)
        return [json.loads(path.read_text()) for path in sorted(Path(out_dir).glob("rank*.json"))]


# Every registered name builds its preset's strategy in tests/strategies/test_presets.py, in process. Trained here from
# a plain script: one preset per engine path (DDP; FSDP2 plain, with activation checkpointing, offloaded; ZeRO
# partitions on the device and offloaded); train.py trains every preset (tests/strategies/test_train_strategies.py).
PLAIN_SCRIPT_PATHS = ["ddp", "fsdp", "fsdp_activation_checkpointing", "fsdp_cpu_offload", "deepspeed_stage_2",
                      "deepspeed_stage_3_offload"]


@pytest.mark.parametrize("name", in_the_suite(PLAIN_SCRIPT_PATHS, ["fsdp_activation_checkpointing", "deepspeed_stage_3_offload"]))
def test_registered_name_trains_on_two_cpu_ranks(name, deepspeed_ops):
    # BoringModel has no repeated block to checkpoint: that preset trains torch's TransformerEncoder instead.
    model = "encoder" if name == "fsdp_activation_checkpointing" else "boring"
    results = run_script(REGISTRY_PREFIX + name, model)
    assert [r["rank"] for r in results] == [0, 1]
    for result in results:
        assert result["strategy"] == PRESETS[name].strategy.__name__
        assert result["backend"] == "gloo"
        assert result["global_step"] == 4
        assert len(result["losses"]) == 4 and all(math.isfinite(loss) for loss in result["losses"])
    sharded = name.startswith("fsdp") or name.startswith("deepspeed_stage_3")
    held = sum(r["parameters_local"] for r in results) / results[0]["parameters_total"]
    assert held == pytest.approx(1.0 if sharded else 2.0, abs=0.05)  # shards add up to one model; replicas to two


def test_configure_model_on_lightnings_data_parallel_axis_trains_under_ld_fsdp():
    results = run_script("ld_fsdp", "mesh")
    reference = run_script("ld_ddp", "boring")
    for result in results:
        assert result["mesh_axes"] == {"data_parallel": 2, "tensor_parallel": 1}
        assert result["fsdp_units"] == 2  # the module's own unit (its layer) and the root, which the strategy adds
        assert result["losses"] == pytest.approx(reference[result["rank"]]["losses"], rel=1e-5)
    assert sum(r["parameters_local"] for r in results) == results[0]["parameters_total"]


def test_configure_model_as_lightnings_tensor_parallel_docs_write_it_trains_under_ld_fsdp_tp():
    # 2 ranks: one tensor-parallel group, which sees one batch; the same model on one rank sees the same batches.
    results = run_script("ld_fsdp_tp", "tensor_parallel")
    (reference,) = run_script("ld_fsdp", "feedforward", "1")
    for result in results:
        assert result["mesh_axes"] == {"data_parallel": 1, "tensor_parallel": 2}
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    # Each rank holds its half of every layer: w1 and w3 split by rows, w2 by columns.
    assert [r["parameters_local"] for r in results] == [reference["parameters_total"] // 2] * 2


def test_strategy_instance_with_block_class_given_as_a_class():
    results = run_script("FSDPStrategy-ac")
    assert [(r["strategy"], r["global_step"]) for r in results] == [("FSDPStrategy", 4), ("FSDPStrategy", 4)]


def test_checkpointing_by_name_without_a_block_says_which_classes_could_be_one():
    stderr = run_script("ld_fsdp_activation_checkpointing", "boring", expect_returncode=1)
    assert (
        "PreflightError: strategy.block_class: activation checkpointing needs the block class and the model has no"
        " nn.ModuleList to infer it from; set it to one of: Linear, RecordingBoringModel"
    ) in stderr
    assert "Initializing distributed" not in stderr  # refused before any rank started


def test_ambiguous_block_class_is_refused_before_launch_naming_the_candidates():
    stderr = run_script("ld_fsdp", "mixed", expect_returncode=1)
    assert (
        "PreflightError: strategy.block_class: cannot infer the model's block class: an nn.ModuleList mixes Linear,"
        " ReLU; set it to the layer class, or a list of them"
    ) in stderr
    assert "Initializing distributed" not in stderr


def test_lightnings_demo_transformer_checkpoints_both_stacks(deepspeed_ops):
    # Lightning's LightningTransformer: an nn.Transformer, whose encoder and decoder layers are two block classes.
    checkpointed = run_script("ld_fsdp_activation_checkpointing", "encoder_decoder")
    reference = run_script("ld_ddp", "encoder_decoder")
    for rank, result in enumerate(checkpointed):
        assert result["checkpointed"] == {"TransformerEncoderLayer": 2, "TransformerDecoderLayer": 2}
        assert result["fsdp_units"] == 5  # four blocks, then the root
        assert result["global_step"] == 4
        assert result["losses"] == pytest.approx(reference[rank]["losses"], rel=1e-5)
    assert reference[0]["checkpointed"] == {} and reference[0]["losses"] != reference[1]["losses"]


def test_deepspeed_config_dict_with_auto_values_trains(deepspeed_ops):
    results = run_script(f"ds-dict:{HF_ZERO2}")
    assert [r["global_step"] for r in results] == [4, 4]
    config = results[0]["deepspeed_config"]
    # BoringModel: loader batch 1, SGD(lr=0.1); 2 ranks.
    assert (config["train_micro_batch_size_per_gpu"], config["train_batch_size"], config["optimizer"]["params"]["lr"]) == (1, 2, 0.1)
    assert config["optimizer"]["params"]["betas"] == [0.9, 0.999]


def test_unfillable_auto_is_reported_before_any_rank_starts():
    stderr = run_script(f"ds-config:{HF_ZERO2}", expect_returncode=1)
    assert "lightning_dist.strategies.launcher.PreflightError: strategy.config (transformers_ds_config_zero2.json): 2 problems: " in stderr
    for key in ("betas", "eps"):
        assert f'optimizer.params.{key}="auto" cannot be filled: configure_optimizers returns SGD, which has no {key}' in stderr
    assert "Initializing distributed" not in stderr  # rank 0 never got as far as the process group
