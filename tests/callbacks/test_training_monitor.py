"""The training monitor: what it logs every step, and a NaN that stops the run at the step where it appeared."""

from __future__ import annotations

import json

import pytest

from tests.conftest import in_the_suite, run_train
from tests.probes import read_batches

pytestmark = pytest.mark.slow

SHORT = ("trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=10", "test=false", "trainer.log_every_n_steps=1")
INJECT = ("+callbacks.nan._target_=tests.probes.InjectNaN", "+callbacks.nan.module=model.blocks.1.mlp",
          "+callbacks.nan.global_step=6", "+callbacks.nan.rank=1")


@pytest.mark.parametrize("strategy", in_the_suite(["ddp", "deepspeed_stage_2"], ["ddp"]))
def test_a_nan_stops_the_run_at_its_step_naming_the_rank_and_the_module(strategy, tmp_path, deepspeed_ops):
    run = run_train(tmp_path, f"strategy={strategy}", *SHORT, *INJECT, "callbacks.training_monitor.locate_module=true")
    assert run.process.returncode == 1
    # Rank 0 speaks for the job (the rank Lightning started leaves with 0): the step, the rank, the losses, where
    # the NaN appeared.
    expected = ("nan) at global step 6 on rank(s) 1; first module with a non-finite output: "
                "model.blocks.1.mlp (Sequential) on rank 1")
    assert run.process.stderr.count("error: non-finite loss (by rank: ") == 1
    assert run.process.stderr.count(expected) == 1, run.process.stderr[-3000:]
    # Stopped before the NaN reached the weights: six steps logged, each with a finite loss and gradient norm.
    rows = [row for row in run.csv_rows() if row.get("train_loss")]
    assert [int(row["step"]) for row in rows][-1] == 5
    assert all(float(row["monitor/grad_norm"]) < 100 for row in rows if row.get("monitor/grad_norm"))


@pytest.mark.extended  # the NaN stop is the test above's; this is its timing at a later check
def test_a_nan_found_at_a_later_check_names_its_own_step_and_is_never_saved(tmp_path):
    """Ranks compare notes only every N steps (no host sync per step) and before every checkpoint: the NaN of step
    6 is found when step 7's checkpoint is about to be written, and that checkpoint is not written.

    Rank 0 is also made the last rank to leave, by 6 s: Lightning's observer of the ranks it started (it looks every
    5 s) then sees rank 1's exit code first, and used to SIGKILL rank 0 for a non-zero one (exit 137, 1 run in 10
    under load)."""
    run = run_train(tmp_path, "strategy=ddp", *SHORT, *INJECT, "callbacks.training_monitor.locate_module=true",
                    "callbacks.training_monitor.check_every_n_steps=10", "callbacks.model_checkpoint.every_n_train_steps=7",
                    "callbacks.model_checkpoint.monitor=null", "callbacks.model_checkpoint.save_top_k=-1",
                    "+callbacks.slow_exit._target_=tests.probes.SlowExitOnRank", "+callbacks.slow_exit.rank=0")
    assert run.process.returncode == 1, run.process.stderr[-3000:]
    expected = ("error: non-finite loss (by rank: 4.308, nan) at global step 6 on rank(s) 1 (found at the check of step 7);"
                " first module with a non-finite output: model.blocks.1.mlp (Sequential) on rank 1")
    assert run.process.stderr.count(expected) == 1, run.process.stderr[-3000:]
    assert sorted(p.name for p in (run.run_dir / "checkpoints").glob("*")) == []


def test_the_monitor_logs_speed_memory_and_gradient_norm_every_step(trained_runs):
    run = trained_runs("fsdp")  # FSDP2's gradients are sharded DTensors: the norm is reduced across ranks
    rows = [row for row in run.csv_rows() if row.get("monitor/step_time_s")]
    assert len(rows) == 20 // 5  # logged at the trainer's log_every_n_steps=5
    # What one step held over all ranks, counted from the batches themselves (tests/probes.py BatchProbe).
    ranks = read_batches(run.run_dir)
    held = {(sum(rank[i]["samples"] for rank in ranks), sum(rank[i]["tokens"] for rank in ranks)) for i in range(20)}
    assert len(ranks) == 2 and len(held) == 1
    (samples, tokens), = held
    probe_times = sorted(batch["seconds"] for batch in ranks[0])
    for row in rows:
        step_time = float(row["monitor/step_time_s"])
        assert probe_times[0] * 0.8 < step_time < probe_times[-1] * 1.2  # one of the steps, by another clock
        assert float(row["monitor/samples_per_s"]) * step_time == pytest.approx(samples, rel=1e-4)
        assert float(row["monitor/tokens_per_s"]) * step_time == pytest.approx(tokens, rel=1e-4)
        assert 0.1 < float(row["monitor/peak_memory_gb"]) < 8
        assert 0 < float(row["monitor/grad_norm"]) < 100
        # Against a peak measured in 0.1 s as the run starts, on cores the other rank (and in the suite, another
        # test) also uses: contention then can leave a step's rate above it (1.11 in one CI run), never far.
        assert 0 < float(row["monitor/mfu"]) < 2
    # MFU: the default model's FLOPs per token (6N + 12 L d T; tests/test_flops.py checks it against torch's count)
    # at the run's token rate, over both ranks' peaks, measured on this CPU when the run started.
    summary = json.loads((run.run_dir / "metrics.json").read_text())
    assert summary["model_flops_per_token"] == 6 * (4 * 12 * 128**2 + 256 * 128) + 12 * 4 * 128 * 128
    assert summary["peak_flops_source"] == "measured: float32 matrix products on this rank's threads"
    assert summary["mfu"] == pytest.approx(
        summary["model_flops_per_token"] * summary["tokens_per_s"] / (2 * summary["peak_flops_per_device"]))
    assert 0 < summary["mfu"] < 2
