"""The two Hugging Face DeepSpeed files, unchanged, through `python train.py strategy=deepspeed strategy.config=...`."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import HF_ZERO2 as ZERO2
from tests.conftest import HF_ZERO3 as ZERO3
from tests.conftest import REPO, cpu_has_fp16, in_the_suite, run_train

pytestmark = pytest.mark.slow

ENGINE_PROBE = (
    "+callbacks.engine_probe._target_=tests.probes.DeepSpeedEngineConfigProbe",
    "+callbacks.engine_probe.path=${paths.output_dir}/engine_config.json",
)
# DeepSpeed 0.19 requires reduce_bucket_size > 0; Hugging Face's ZeRO-3 file has 0, so it is refused on any device.
BUCKET_REFUSAL = "zero_optimization.reduce_bucket_size=0: DeepSpeed 0.19.8 refuses it (Input should be greater than 0)"
SHORT = ("trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=8", "test=false")


from lightning_dist.strategies.deepspeed.config.resolve import auto_keys  # noqa: E402


@pytest.fixture(scope="session")
def zero2_runs(tmp_path_factory, deepspeed_ops):
    runs = {}

    def get(precision: str):
        if precision not in runs:
            runs[precision] = run_train(
                tmp_path_factory.mktemp(f"zero2-{precision}"), "strategy=deepspeed", f"strategy.config={ZERO2}",
                f"trainer.precision={precision}", *SHORT, *ENGINE_PROBE,
            )
        return runs[precision]

    return get


@pytest.mark.parametrize("precision", in_the_suite(["32-true", "bf16-mixed", "bf16-true"], ["32-true"]))
def test_all_auto_zero2_file_trains_under_every_cpu_precision(zero2_runs, precision):
    run = zero2_runs(precision)
    assert run.process.returncode == 0, run.output[-3000:]
    assert run.summary["train_batches_per_rank"] == [8, 8]
    losses = run.val_losses()
    assert losses[max(losses)] < losses[0] - 0.1, losses
    effective = json.loads((run.run_dir / "deepspeed_config.effective.json").read_text())
    assert auto_keys(effective) == []
    bf16 = precision.startswith("bf16")
    assert (effective["bf16"]["enabled"], effective["fp16"]["enabled"]) == (bf16, False)
    assert (effective["train_micro_batch_size_per_gpu"], effective["gradient_accumulation_steps"], effective["train_batch_size"]) == (16, 1, 32)
    assert effective["optimizer"]["params"] == {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}


def test_filled_and_untouched_keys_reach_the_engine(zero2_runs):
    engine = json.loads((zero2_runs("bf16-mixed").run_dir / "engine_config.json").read_text())
    zero = engine["zero"]
    assert zero["stage"] == 2
    assert (zero["allgather_bucket_size"], zero["reduce_bucket_size"]) == (200_000_000, 200_000_000)
    assert zero["overlap_comm"] is zero["reduce_scatter"] is zero["contiguous_gradients"] is zero["allgather_partitions"] is True
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_optimizer"]["pin_memory"] is True
    fp16 = engine["fp16"]
    assert (fp16["enabled"], fp16["loss_scale_window"], fp16["initial_scale_power"], fp16["hysteresis"], fp16["min_loss_scale"]) == (False, 1000, 16, 2, 1)
    assert engine["bf16"]["enabled"] is True
    assert (engine["steps_per_print"], engine["wall_clock_breakdown"], engine["gradient_clipping"]) == (2000, False, 0.0)
    assert (engine["train_micro_batch_size_per_gpu"], engine["gradient_accumulation_steps"], engine["train_batch_size"]) == (16, 1, 32)
    # The file's optimizer block builds the optimizer; with offload, DeepSpeed makes it its CPU Adam.
    assert engine["optimizer_name"] == "adamw" and engine["optimizer_class"] == "DeepSpeedCPUAdam"
    assert engine["optimizer_params"]["lr"] == 1e-3 and engine["optimizer_params"]["betas"] == [0.9, 0.95]
    assert engine["scheduler_name"] == "WarmupLR" and engine["scheduler_params"]["warmup_max_lr"] == 1e-3


def test_zero3_keys_and_explicit_optimizer_values_reach_the_engine(tmp_path, deepspeed_ops):
    # The ZeRO-3 file with fp16 left to the Trainer, so that it runs on this fp16-less CPU, and the reduce bucket
    # size (0, which DeepSpeed 0.19 refuses) left to the hidden-size rule.
    config = json.loads(ZERO3.read_text())
    config["fp16"]["enabled"] = "auto"
    config["zero_optimization"]["reduce_bucket_size"] = "auto"
    path = tmp_path / "zero3_fp16_auto.json"
    path.write_text(json.dumps(config))
    run = run_train(tmp_path / "run", "strategy=deepspeed", f"strategy.config={path}", *SHORT, *ENGINE_PROBE, "test=true")
    assert run.process.returncode == 0, run.output[-3000:]
    assert "test_loss" in run.summary["metrics"]  # Lightning's ZeRO-3 test path ran after fit
    engine = json.loads((run.run_dir / "engine_config.json").read_text())
    zero = engine["zero"]
    assert zero["stage"] == 3 and zero["sub_group_size"] == 100_000_000_000_000
    assert (zero["stage3_max_live_parameters"], zero["stage3_max_reuse_distance"]) == (1_000_000_000, 1_000_000_000)
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"], zero["stage3_param_persistence_threshold"]) == (128 * 128, 0, 0)
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True  # the file says it under its old fp16 name
    assert zero["offload_param"]["device"] == "cpu" and zero["offload_param"]["pin_memory"] is True
    # Explicit optimizer and scheduler values in the file win over the module's (documented precedence).
    assert engine["optimizer_params"] == {"lr": 3e-5, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}
    assert engine["scheduler_params"] == {"warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 500}
    assert run.summary["placement_per_rank"][0]["parameters_local"] < run.summary["placement_per_rank"][0]["parameters_total"]


ZERO3_SOURCE = "error: strategy.config (transformers_ds_config_zero3.json): "
# The file's fp16 decides where the Trainer keeps its default 32-true; on a CPU without fp16 that is refused too.
FILE_FP16 = ('fp16.enabled=true: this CPU has no fp16 support in DeepSpeed (its CPU accelerator needs AVX512-FP16/AMX-FP16);'
             ' set it to "auto" or false, or run on CUDA')


@pytest.mark.parametrize("precision, message", [
    ("16-mixed", ZERO3_SOURCE + "1 problem: " + BUCKET_REFUSAL if cpu_has_fp16()
     else "error: trainer.precision=16-mixed: DeepSpeed's CPU accelerator has no fp16 on this CPU"),
    ("bf16-mixed", ZERO3_SOURCE + '2 problems: fp16.enabled=true but trainer.precision=bf16-mixed (set it to "auto" or false) | ' + BUCKET_REFUSAL),
    ("32-true", ZERO3_SOURCE + ("1 problem: " if cpu_has_fp16() else f"2 problems: {FILE_FP16} | ") + BUCKET_REFUSAL),
])
def test_zero3_file_with_hard_coded_fp16_is_refused_or_reported_before_launch(tmp_path, precision, message):
    run = run_train(tmp_path, "strategy=deepspeed", f"strategy.config={ZERO3}", f"trainer.precision={precision}", *SHORT)
    assert run.process.returncode == 2
    assert run.process.stderr.strip().splitlines()[-1].startswith(message)
    assert not (tmp_path / "train_ddp_process_1.log").exists()


def test_a_preset_as_base_reports_its_options_against_the_file_with_the_trainer(tmp_path):
    run = run_train(tmp_path, "strategy=deepspeed_stage_3", f"strategy.config={ZERO2}", "trainer.precision=bf16-mixed",
                    "trainer.gradient_clip_val=1.0", *SHORT)
    assert run.process.returncode == 2, run.output[-2000:]
    assert run.process.stderr.strip().splitlines()[-1] == (
        "error: strategy.config (transformers_ds_config_zero2.json): 1 problem: zero_optimization.stage=2 but strategy.stage=3 (make them agree)"
    )


# DeepSpeed's own performance tools, as a user turns them on: timers, CSV monitor, flops profiler (relative paths).
MONITORED = {
    "steps_per_print": 5,
    "wall_clock_breakdown": True,
    "csv_monitor": {"enabled": True, "output_path": "ds_monitor/", "job_name": "probe"},
    "flops_profiler": {"enabled": True, "profile_step": 2, "output_file": "flops_profile.txt"},
}


@pytest.mark.extended  # DeepSpeed's own instruments, not ours: the rest of the file is what we fill in
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeeds_timers_monitor_and_flops_profiler_work_and_write_into_the_run(stage, tmp_path, deepspeed_ops):
    config = tmp_path / "monitored.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": stage}, **MONITORED}))
    run = run_train(tmp_path / "run", "strategy=deepspeed", f"strategy.config={config}", "trainer.accelerator=cpu",
                    "trainer.devices=2", "trainer.max_steps=10", f"test={'true' if stage == 3 else 'false'}")
    assert run.process.returncode == 0, run.output[-3000:]
    # Before the fix: "fwd_microstep timer has already been started" (the root module runs inside itself).
    breakdown = [line for line in run.output.splitlines() if "time (ms) | fwd_microstep: " in line]
    assert len(breakdown) >= 2, run.output[-3000:]
    monitor = run.run_dir / "ds_monitor" / "probe"
    rows = (monitor / "Train_Samples_lr.csv").read_text().splitlines()
    assert rows[0].startswith("step") and len(rows) >= 10 and float(rows[-1].split(",")[-1]) == pytest.approx(1e-3)
    assert (monitor / "Train_Samples_elapsed_time_ms_forward.csv").is_file()
    profile = (run.run_dir / "flops_profile.txt").read_text()
    assert "DeepSpeed Flops Profiler" in profile and "params per GPU" in profile
    assert not (REPO / "ds_monitor").exists() and not (REPO / "flops_profile.txt").exists()
    if stage == 3:  # Lightning's test path under ZeRO-3 (its inference engine) runs after fit
        assert "test_loss" in run.summary["metrics"]


SGD_STEP = (
    "model._target_=tests.models.checkpoint_probe.CheckpointProbeGPT", "+model.gathered_path=${paths.output_dir}/gathered_state.pt",
    "+model.loss_multiplier=1000", "optimizer=sgd", "model.optimizer.lr=0.01", "model.optimizer.momentum=0",
    "trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=1", "test=false",
)


def test_a_files_clipping_applies_when_the_trainer_sets_none_and_two_values_are_a_mismatch(tmp_path, deepspeed_ops):
    config = tmp_path / "clip.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0}))
    run = run_train(tmp_path / "run", "strategy=deepspeed", f"strategy.config={config}", *SGD_STEP)
    assert run.process.returncode == 0, run.output[-3000:]
    assert "gradient_clipping=1 comes from strategy.config (clip.json); the Trainer sets no gradient_clip_val" in run.output
    before, after = (torch.load(run.run_dir / name) for name in ("initial_state.pt", "gathered_state.pt"))
    names = [n for n in after if n not in ("model.lm_head.weight", "bytes_seen") and after[n].is_floating_point()]
    post_clip_norm = sum(float((after[n] - before[n]).double().pow(2).sum()) for n in names) ** 0.5 / 0.01
    assert post_clip_norm == pytest.approx(1.0, abs=1e-3)  # the raw norm is in the hundreds

    mismatch = run_train(tmp_path / "mismatch", "strategy=deepspeed", f"strategy.config={config}", *SGD_STEP, "trainer.gradient_clip_val=0.5")
    assert mismatch.process.returncode == 2
    assert mismatch.process.stderr.strip().splitlines()[-1] == (
        "error: strategy.config (clip.json): 1 problem: gradient_clipping=1 but trainer.gradient_clip_val=0.5"
        " (set it to \"auto\" or 0.5)"
    )


def test_a_files_precision_and_accumulation_decide_where_the_trainer_keeps_lightnings_defaults(tmp_path, deepspeed_ops):
    config = tmp_path / "bf16_accumulate.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 2, "bf16": {"enabled": True}}))
    run = run_train(tmp_path / "run", "strategy=deepspeed", f"strategy.config={config}", "trainer.accelerator=cpu",
                    "trainer.devices=2", "trainer.max_steps=2", "test=false")
    assert run.process.returncode == 0, run.output[-3000:]
    assert "trainer.precision=bf16-mixed comes from bf16.enabled=true in strategy.config (bf16_accumulate.json); the Trainer sets none" in run.output
    assert "trainer.accumulate_grad_batches=2 comes from gradient_accumulation_steps=2 in strategy.config (bf16_accumulate.json)" in run.output
    summary = run.summary
    assert (summary["global_step"], summary["train_batches_per_rank"]) == (2, [4, 4])  # two micro-batches per step
    assert summary["placement_per_rank"][0]["parameter_dtypes"] == ["torch.bfloat16"]
    effective = json.loads((run.run_dir / "deepspeed_config.effective.json").read_text())
    assert (effective["gradient_accumulation_steps"], effective["train_micro_batch_size_per_gpu"], effective["bf16"]) == (2, 16, {"enabled": True})
