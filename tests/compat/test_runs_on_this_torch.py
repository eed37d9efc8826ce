"""On the torch of this venv (CI's compatibility tier: the oldest and the newest we support), each engine and layout
trains with a validation and a checkpoint, as the command users type, from a fresh directory, and each checkpoint
format resumes; compiled blocks train; the dry run sets up and steps at 4 ranks with CUDA faked."""

from __future__ import annotations

import csv
import json
import shlex
import subprocess
import sys

import pytest

from lightning_dist.reports.equivalence import read_train_losses
from tests.conftest import PRESET_NAMES, REPO, TRAIN_ENV

pytestmark = [pytest.mark.compat, pytest.mark.slow]
TESTS_SHARE_NOTHING = True  # each its own runs in its own directory: spread over the tier's workers (tests/conftest.py)

# The acceptance command, as typed (tensor parallelism splits each layer over 2 of 4 ranks).
COMMAND = "python train.py strategy={name} trainer.max_steps=6 trainer.val_check_interval=3"
# hsdp_tp replicated twice: its data-parallel axis is the flattened replicate x shard (torch deprecates slicing it).
WIDER = {"fsdp_tp": "trainer.devices=4", "hsdp_tp": "trainer.devices=4 strategy.data_parallel_replicate_size=2",
         "fsdp_tp_pp": "trainer.devices=4",  # 2 pipeline stages x 2 tensor-parallel ranks
         "fsdp_activation_checkpointing": "strategy.cpu_offload=true"}


def typed(command: str, cwd, *more: str) -> subprocess.CompletedProcess:
    words = shlex.split(command)
    assert words[:2] == ["python", "train.py"]
    return subprocess.run([sys.executable, str(REPO / "train.py"), *words[2:], *more], cwd=cwd, capture_output=True,
                          text=True, timeout=900, env=TRAIN_ENV)


def only_run(cwd):
    (run_dir,) = (cwd / "logs" / "train" / "runs").iterdir()
    return run_dir


def logged_steps(run_dir) -> list[int]:
    with open(run_dir / "csv" / "metrics.csv") as handle:
        return sorted({int(row["step"]) for row in csv.DictReader(handle) if row.get("train_loss")})


# The NVMe preset's I/O op takes 5 minutes of both cores to build for each torch, which CI's hour cannot spare
# (.ci/compat_tier builds CPU Adam only): on the tier's torch it runs Lightning's whole loop on fake CUDA instead
# (tests/test_loop_on_cuda.py), where its swaps are traced as host offload; on the default torch it trains for real.
# What differs between torch releases is the torch each engine and layout calls, not a preset's options: the tier
# trains one preset for each (CI's hour holds two torches' tiers after the main suite), and resumes one for each
# checkpoint format and mesh (DDP's whole state, DCP's shards on a 1-D, a replicated 3-D and a pipelined 2-D mesh,
# ZeRO-1's and ZeRO-3's partitions). FSDP's two torch features beyond sharding, activation checkpointing's wrapper and
# the host offload policy, train in one run. Left to the main suite's torch: deepspeed_stage_2 and its offload
# (ZeRO-1 runs the same stage_1_and_2 engine here, ZeRO-3's offload the same CPU Adam), deepspeed_stage_3 (trains
# here with offload), fsdp_shard_grad_op (an argument of the same fully_shard call, which every FSDP run makes with
# it for the root module), fsdp_cpu_offload (in the checkpointing run), fsdp_tp (hsdp_tp and fsdp_tp_pp hold its mesh
# and plan), fsdp_pp (fsdp_tp_pp's stages, and the V schedule below).
RESUMED = ["ddp", "fsdp", "hsdp_tp", "fsdp_tp_pp", "deepspeed_stage_1", "deepspeed_stage_3_offload"]
TRAINED = RESUMED + ["fsdp_activation_checkpointing"]
assert set(TRAINED) <= set(PRESET_NAMES)
# torch 2.11 moves FSDP2's DTensor parameters by swapping them, which a weak reference to a parameter refuses: there
# `trainer.test` after `trainer.fit` failed under the pipeline presets alone. The torch engine's runs swap every
# parameter they move, on every torch (DeepSpeed's engine holds finalizers on its own parameters, and moves plain
# tensors in place on every torch).
SWAPPED = "+callbacks.swap_on_conversion._target_=tests.probes.SwapParametersOnConversion"


@pytest.mark.parametrize("name", TRAINED)
def test_each_engine_and_layout_trains_validates_saves_and_each_format_resumes(name, tmp_path):
    command = " ".join([COMMAND.format(name=name), WIDER.get(name, "")]).strip()
    first_dir, resumed_dir = tmp_path / "first", tmp_path / "resumed"
    first_dir.mkdir(), resumed_dir.mkdir()
    first = typed(command, first_dir, *([] if name.startswith("deepspeed") else [SWAPPED]))
    assert first.returncode == 0, first.stderr[-4000:]
    run_dir = only_run(first_dir)
    summary = json.loads((run_dir / "metrics.json").read_text())
    assert summary["global_step"] == 6 and summary["metrics"]["val_loss"] > 0 and summary["metrics"]["test_loss"] > 0
    last = run_dir / "checkpoints" / "last.ckpt"
    assert last.exists()
    if name not in RESUMED:
        return

    resumed = typed(command.replace("max_steps=6", "max_steps=8"), resumed_dir, f"ckpt_path={last}", "test=false")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    resumed_summary = json.loads((only_run(resumed_dir) / "metrics.json").read_text())
    assert resumed_summary["global_step"] == 8
    assert min(logged_steps(only_run(resumed_dir)), default=0) > 6  # continued after step 6, not from the start


def test_compiled_blocks_train_under_fsdp(tmp_path):
    run = typed(COMMAND.format(name="fsdp"), tmp_path, "compile=true", "test=false")
    assert run.returncode == 0, run.stderr[-4000:]
    summary = json.loads((only_run(tmp_path) / "metrics.json").read_text())
    assert summary["global_step"] == 6 and summary["metrics"]["val_loss"] > 0


# FSDP's dry run at 4 ranks: the ring-attention dry run's below, the same command with context parallelism added (39 s of
# each tier on CI for a second run of it).
@pytest.mark.parametrize("name", ["deepspeed_stage_3"])
def test_the_dry_run_sets_up_and_steps_at_4_ranks_with_cuda_faked(name, tmp_path):
    run = typed(f"python train.py dry_run=true trainer=gpu trainer.devices=4 strategy={name}", tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "ranks (4 per node) on fake CUDA devices (this machine has none)" in run.stdout
    assert "**peak**" in run.stdout


def test_ring_attention_dry_runs_with_cuda_faked_on_this_torch(tmp_path):
    """torch's context-parallel API (its ring over CUDA's flash kernel, its load-balanced shards) as this torch has it."""
    run = typed("python train.py dry_run=true trainer=gpu trainer.devices=4 strategy=fsdp"
                " strategy.context_parallel_size=2 strategy.context_parallel=ring", tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "rank 3: data_parallel_shard=1, context_parallel=1, tensor_parallel=0" in run.stdout
    assert "**peak**" in run.stdout


def test_a_v_schedule_trains_or_is_refused_in_one_line_on_this_torch(tmp_path):
    """ZBVZeroBubble holds the first and the last stage on one rank: torch 2.13 and 2.15 run it (the suite compares
    its losses with ddp's), torch 2.11 sends its warm-up from the rank to itself, which gloo refuses, so there it is
    refused before launch, saying what does run."""
    from lightning_dist._compat.torch import runs_v_schedules

    run = typed("python train.py strategy=fsdp_pp trainer.devices=4 strategy.pipeline_schedule=ZBVZeroBubble"
                " strategy.stages_per_rank=2 trainer.max_steps=4 trainer.val_check_interval=2", tmp_path)
    if runs_v_schedules():
        assert run.returncode == 0, run.stderr[-4000:]
        summary = json.loads((only_run(tmp_path) / "metrics.json").read_text())
        assert summary["global_step"] == 4 and summary["metrics"]["test_loss"] > 0
    else:
        assert run.returncode == 2
        assert run.stderr.strip().splitlines()[-1].startswith(
            "error: strategy.pipeline_schedule=ZBVZeroBubble: torch 2.11.0")
        assert not (tmp_path / "logs").exists() or not list((tmp_path / "logs").rglob("metrics.json"))


def test_context_parallelism_trains_the_losses_of_whole_sequences_on_this_torch(tmp_path):
    """all_to_all's exchange (torch's differentiable functional all-to-all) on 2 x 2 ranks: the losses of the same
    batches without context parallelism on the 2 data-parallel ranks."""
    losses = {}
    for name, layout in (("cp", "trainer.devices=4 strategy.context_parallel_size=2"), ("whole", "trainer.devices=2")):
        (tmp_path / name).mkdir()
        run = typed(f"python train.py strategy=fsdp {layout} trainer.max_steps=6 test=false trainer.log_every_n_steps=1",
                    tmp_path / name)
        assert run.returncode == 0, run.stderr[-4000:]
        losses[name] = read_train_losses(only_run(tmp_path / name))
    assert sorted(losses["cp"]) == sorted(losses["whole"]) == list(range(6))
    for step, loss in losses["whole"].items():
        assert losses["cp"][step] == pytest.approx(loss, rel=1e-5), step
