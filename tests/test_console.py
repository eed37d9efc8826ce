"""What `python train.py` prints (issue 16): each line a person needs once, no library noise before the progress
bar. Read from the acceptance runs of ddp and ZeRO-3 (2 ranks each), as a user's console shows them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, TRAIN_ENV

pytestmark = pytest.mark.slow


# What a new user's first runs printed that nobody running them can act on, or that our own line already says.
NOISE = (
    "GPU available", "TPU available", "Seed set to", "distributed_backend=", "All distributed processes registered",
    "Setting accelerator to CPU", "Using `DistributedSampler`", "site-packages", "`Trainer.fit` stopped", "💡",
    "Instantiating", "LeafSpec", "is deprecated", "compilers.C",
    "Warning",  # a Hydra callback missing a hook makes Hydra warn on every run, as ours did (one per hook)
)


@pytest.mark.parametrize("name", ["ddp", "deepspeed_stage_3"])
def test_each_line_once_and_no_library_noise(trained_runs, name):
    run = trained_runs(name)
    assert run.process.returncode == 0, run.output[-3000:]
    output = run.output
    assert output.count(f"Training gpt_tiny (0.84M parameters) on pydoc_text with {name}, 2 cpu ranks, 32-true, "
                        f"seed 42; outputs in {run.run_dir}") == 1
    assert "[rank: 1]" not in output
    assert output.count("nitializing") == 1  # Lightning's "Initializing distributed" (DeepSpeed: "initializing deepspeed ...")
    assert [noise for noise in NOISE if noise in output] == []


def test_a_step_bounded_run_counts_its_optimizer_steps(trained_runs):
    stdout = trained_runs("ddp").process.stdout
    assert "epoch 0: step 20/20 100%" in stdout and "Epoch 0:" not in stdout  # one bar over the run, not per epoch


def train_in(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "train.py"), *overrides], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env=TRAIN_ENV)


@pytest.mark.parametrize("case", ["constructor", "pre-launch check"])
def test_a_refused_config_says_one_line_before_anything_else_and_leaves_no_run_directory(tmp_path, case, deepspeed_ops):
    if case == "constructor":  # refused while the job builds the strategy, after Hydra made the run directory
        overrides, expected = ["strategy=deepspeed_stage_2", "strategy.stage=7"], "error: strategy.stage: 7 is not a ZeRO stage"
    else:  # refused by DeepSpeed's pre-launch check, inside trainer.fit's set-up
        config = tmp_path / "ds.json"
        config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}))
        overrides, expected = ["strategy=deepspeed", f"strategy.config={config}"], "error: strategy.config (ds.json)"
    process = train_in(tmp_path, *overrides)
    assert process.returncode == 2, process.stderr[-3000:]
    errors = [line for line in process.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(expected), process.stderr[-3000:]
    assert "Training " not in process.stdout + process.stderr and "Traceback" not in process.stderr
    # No run directory, nor the empty logs/train/runs/ it was made in; only what the test itself wrote.
    assert sorted(p.name for p in tmp_path.iterdir()) == (["ds.json"] if case != "constructor" else [])


def test_help_and_the_composed_config_load_no_engine():
    # `--help` and `--cfg job` answer from Hydra alone: torch, Lightning and DeepSpeed would cost seconds.
    for flag in ("--help", "--cfg=job"):
        process = subprocess.run([sys.executable, "-X", "importtime", str(REPO / "train.py"), flag], capture_output=True,
                                 text=True, timeout=120, env=TRAIN_ENV)
        assert process.returncode == 0, process.stderr[-2000:]
        imported = {line.split("|")[-1].strip() for line in process.stderr.splitlines() if line.startswith("import time:")}
        assert "hydra" in imported and not imported & {"torch", "lightning", "deepspeed"}, flag
    assert "== Config ==" in process.stdout or "strategy:" in process.stdout
