"""`python train.py strategy=NAME trainer.devices=2 trainer.max_steps=20` for every named strategy."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import TRAIN_ENV

pytestmark = pytest.mark.slow

N_LAYER = 4  # conf/model/gpt_tiny.yaml


def test_exits_zero_and_reports_outputs(strategy_run):
    name, run = strategy_run
    assert run.process.returncode == 0, run.output[-4000:]
    assert f"Outputs: {run.run_dir}" in run.process.stdout
    # DeepSpeed's shared-memory comm op is for inference only: never built (a minute of compiling on a first run).
    assert "shm_comm" not in run.output


def test_both_ranks_train_every_step(strategy_run):
    _, run = strategy_run
    summary = run.summary
    assert summary["world_size"] == 2
    assert summary["process_group_backend"] == "gloo"  # host state or not: on CPU every tensor is a host tensor
    assert summary["global_step"] == 20
    assert summary["train_batches_per_rank"] == [20, 20]
    # Each rank its share of the cores (Lightning set it only for the rank it runs in, after starting the others).
    # The environment the runs were started with: in-process Lightning runs later in a session set OMP_NUM_THREADS.
    share = int(TRAIN_ENV.get("OMP_NUM_THREADS", 0)) or max(1, len(os.sched_getaffinity(0)) // 2)
    assert summary["intra_op_threads_per_rank"] == [share, share]


def test_validation_loss_falls(strategy_run):
    _, run = strategy_run
    losses = run.val_losses()
    assert min(losses) == 0 and max(losses) >= 19, losses  # validated before training and after the last step
    assert losses[max(losses)] < losses[0] - 0.5, losses


def test_checkpoint_exists(strategy_run):
    name, run = strategy_run
    last = Path(run.summary["last_checkpoint"])
    assert last.parent == run.run_dir / "checkpoints"
    if name == "ddp":
        assert last.is_file() and last.stat().st_size > 1_000_000  # ~0.84M float32 parameters and Adam state
        said = f"Last checkpoint: {last}"
    else:  # sharded: a directory with one part per rank
        assert last.is_dir() and sum(f.stat().st_size for f in last.rglob("*") if f.is_file()) > 1_000_000
        said = (f"Last checkpoint: {last} (shards; one file: lightning-dist consolidate {last}"
                " model.ckpt)")
    assert said in run.process.stdout.splitlines()


def _expected_placement(name: str) -> dict:
    sharded = name.startswith("fsdp") or name.startswith("deepspeed_stage_3")
    offload = {"optimizer": None, "parameters": None}
    if name == "fsdp_cpu_offload" or name == "deepspeed_stage_3_offload":
        offload = {"optimizer": "cpu", "parameters": "cpu"}
    elif name == "deepspeed_stage_2_offload":
        offload = {"optimizer": "cpu", "parameters": None}
    return {"sharded": sharded, "offload": offload}


def test_parameters_sharded_and_offloaded_as_named(strategy_run):
    name, run = strategy_run
    expected = _expected_placement(name)
    for rank in run.summary["placement_per_rank"]:
        share = rank["parameters_local"] / rank["parameters_total"]
        if expected["sharded"]:
            assert share == pytest.approx(0.5, abs=0.02), rank
        else:
            assert share == 1.0, rank
        assert rank["offload"] == expected["offload"], rank
        if expected["offload"]["optimizer"]:
            assert rank["optimizer_state_devices"] == ["cpu"]
        if name.endswith("offload") and name.startswith("deepspeed"):
            assert rank["optimizer_classes"] == ["DeepSpeedCPUAdam"]  # torch AdamW swapped for the host kernel


def test_fsdp_wraps_each_block_once(strategy_run):
    name, run = strategy_run
    # FSDP: one unit per TransformerBlock plus the root; the others have none. Checkpointing: one wrapper per block.
    expected_units = N_LAYER + 1 if name.startswith("fsdp") else 0
    expected_checkpoints = N_LAYER if name == "fsdp_activation_checkpointing" else 0
    for rank in run.summary["placement_per_rank"]:
        assert rank["fsdp_units"] == expected_units
        assert rank["checkpointed_blocks"] == expected_checkpoints
