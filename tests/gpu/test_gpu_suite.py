"""On a CUDA device (world size 1, nccl): every preset trains, validates and tests with the model's metrics, matches
DDP in fp32, runs the precisions the matrix promises, saves, resumes and consolidates, and reports CUDA peak memory;
the tensor-parallel presets train where 2 GPUs are visible. Run by scripts/gpu_check.sh; deselected where the GPUs
a test needs are not visible."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lightning_dist.reports.equivalence import read_train_losses
from tests.conftest import REPO, TENSOR_PARALLEL_NAMES
from tests.gpu.conftest import FP32_RUN, GPU, NVME, ONE_DEVICE_NAMES, PRECISION_CELLS, RESUMED, STEPS, run_many
from tests.strategies.test_cuda_choices import expected_backend

pytestmark = pytest.mark.gpu

HOST_PARAMETERS = {"fsdp_cpu_offload", "deepspeed_stage_3_offload"}
FP32_TOLERANCE = 1e-5


def relative_gaps(losses: dict[int, float], reference: dict[int, float]) -> list[float]:
    return [abs(losses[step] - reference[step]) / abs(reference[step]) for step in sorted(reference)]


@pytest.mark.parametrize("name", ONE_DEVICE_NAMES)
def test_every_preset_trains_twenty_steps_on_one_gpu_with_nccl(fp32_runs, measurements, name):
    run = fp32_runs[name]
    assert run.process.returncode == 0, run.output[-4000:]
    summary = run.summary
    assert summary["process_group_backend"] == expected_backend(name)
    assert (summary["world_size"], summary["global_step"], summary["train_batches_per_rank"]) == (1, STEPS, [STEPS])
    (placement,) = summary["placement_per_rank"]
    assert placement["parameter_devices"] == (["cpu"] if name in HOST_PARAMETERS else ["cuda"])
    (peak,) = summary["peak_memory_per_rank"]
    assert peak["kind"] == "cuda_max_allocated" and peak["bytes"] > 0
    losses = read_train_losses(run.run_dir)
    assert sorted(losses) == list(range(STEPS)) and losses[STEPS - 1] < losses[0]
    measurements["fp32"][name] = {
        "final_loss": losses[STEPS - 1], "peak_cuda_bytes": peak["bytes"],
        "median_step_time_s": summary.get("median_step_time_s"), "placement": placement["parameter_devices"],
    }


@pytest.mark.parametrize("name", ONE_DEVICE_NAMES)
def test_every_preset_validates_and_tests_with_the_model_s_metrics(fp32_runs, measurements, name):
    """The sanity check, the validation at the last step and the test loop all update torchmetrics metrics on the
    device; a state left on the host fails the first of them."""
    run = fp32_runs[name]
    assert run.process.returncode == 0, run.output[-4000:]
    metrics = run.summary["metrics"]
    found = {key: metrics.get(key) for key in ("val_loss", "val_ppl", "test_loss", "test_ppl")}
    assert all(value is not None and 0 < value < 1e4 for value in found.values()), found
    validated_at = sorted(run.val_losses())
    assert validated_at[0] == 0 and validated_at[-1] >= STEPS - 1, validated_at  # the sanity check and the last step
    measurements["fp32"].setdefault(name, {}).update({"val_loss": found["val_loss"], "test_loss": found["test_loss"]})


def test_nvme_offload_trains_ddps_losses_or_is_refused_in_one_line_without_libaio(fp32_runs, tmp_path, measurements):
    """Where libaio's headers are installed, ZeRO-3 offloads to a directory and trains ddp's fp32 losses; where not
    (the H200 of 2026-12-04), the run stops before it starts with the line that says what to install."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    (tmp_path / "nvme").mkdir()
    run = run_many({NVME: (tmp_path, [f"strategy={NVME}", *GPU, *FP32_RUN, f"strategy.nvme_path={tmp_path / 'nvme'}"])})[NVME]
    if not AsyncIOBuilder().is_compatible(verbose=False):
        measurements["fp32"][NVME] = {"refused": run.process.stderr.strip().splitlines()[-1]}
        assert run.process.returncode != 0
        assert run.process.stderr.strip().splitlines()[-1] == (
            "error: offload cannot start: DeepSpeed's async_io op cannot be built here: install libaio's headers"
            " (apt-get install libaio-dev on Debian/Ubuntu, yum install libaio-devel on RHEL); `ds_report` then shows"
            " async_io [OKAY]")
        return
    assert run.process.returncode == 0, run.output[-4000:]
    assert run.summary["placement_per_rank"][0]["parameter_devices"] == ["cpu"]
    gap = max(relative_gaps(read_train_losses(run.run_dir), read_train_losses(fp32_runs["ddp"].run_dir)))
    measurements["fp32"][NVME] = {"max_relative_gap_vs_ddp": gap}
    assert gap <= FP32_TOLERANCE


@pytest.mark.parametrize("name", [n for n in ONE_DEVICE_NAMES if n != "ddp"])
def test_fp32_losses_equal_ddps_at_every_step(fp32_runs, measurements, name):
    reference = read_train_losses(fp32_runs["ddp"].run_dir)
    losses = read_train_losses(fp32_runs[name].run_dir)
    assert losses.keys() == reference.keys()
    gap = max(relative_gaps(losses, reference))
    measurements["fp32"].setdefault(name, {})["max_relative_gap_vs_ddp"] = gap
    assert gap <= FP32_TOLERANCE


@pytest.mark.parametrize("name", ONE_DEVICE_NAMES)
def test_the_monitor_logs_cuda_peak_memory_and_a_gradient_norm(fp32_runs, name):
    rows = [row for row in fp32_runs[name].csv_rows() if row.get("monitor/peak_memory_gb")]
    assert len(rows) == STEPS
    peak_gb = fp32_runs[name].summary["peak_memory_per_rank"][0]["bytes"] / 1e9
    # Logged values pass through float32: the run's peak (exact, in metrics.json) bounds them to rounding.
    assert all(0 < float(row["monitor/peak_memory_gb"]) <= peak_gb * (1 + 1e-6) for row in rows)
    norms = [float(row["monitor/grad_norm"]) for row in fp32_runs[name].csv_rows() if row.get("monitor/grad_norm")]
    assert len(norms) == STEPS and all(0 < norm < 100 for norm in norms)


@pytest.mark.parametrize("cell", PRECISION_CELLS, ids="-".join)
def test_the_cuda_precisions_of_the_matrix_train(precision_runs, measurements, cell):
    run = precision_runs[cell]
    assert run.process.returncode == 0, run.output[-4000:]
    losses = read_train_losses(run.run_dir)
    assert len(losses) == 10 and all(0 < loss < 10 for loss in losses.values())
    (placement,) = run.summary["placement_per_rank"]
    measurements["precision"]["|".join(cell)] = {"final_loss": losses[9], "parameter_dtypes": placement["parameter_dtypes"],
                                                "peak_cuda_bytes": run.summary["peak_memory_per_rank"][0]["bytes"]}


@pytest.mark.parametrize("name", RESUMED)
def test_a_run_resumed_from_step_ten_repeats_the_uninterrupted_losses(fp32_runs, resumed_runs, measurements, name):
    run = resumed_runs[name]
    assert run.process.returncode == 0, run.output[-4000:]
    uninterrupted = read_train_losses(fp32_runs[name].run_dir)
    resumed = read_train_losses(run.run_dir)
    assert sorted(resumed) == list(range(10, STEPS))
    gap = max(relative_gaps(resumed, {step: uninterrupted[step] for step in resumed}))
    measurements["resume"][name] = {"max_relative_gap": gap}
    assert gap <= FP32_TOLERANCE


@pytest.mark.parametrize("name", RESUMED)
def test_the_last_checkpoint_consolidates_into_a_file_that_loads_without_a_gpu_process_group(fp32_runs, measurements,
                                                                                              tmp_path, name):
    run = fp32_runs[name]
    output = tmp_path / "model.ckpt"
    consolidate = subprocess.run([sys.executable, "-m", "lightning_dist.checkpoints.consolidate",
                                  str(run.run_dir / "checkpoints" / "last.ckpt"), str(output)], cwd=REPO, capture_output=True, text=True)
    assert consolidate.returncode == 0, consolidate.stderr[-3000:]
    load = subprocess.run([sys.executable, "-m", "tests.checkpoints_plain_load", str(output), str(run.run_dir / "gathered_state.pt")],
                          cwd=REPO, capture_output=True, text=True)
    # The checker prints `PATH: OK`, or `PATH: AssertionError: what differed`, for each file it loads.
    measurements["consolidated"][name] = load.stdout.strip().removeprefix(f"{output}: ") or load.stderr[-300:]
    assert load.stdout.strip() == f"{output}: OK", (load.stdout + load.stderr)[-3000:]


@pytest.mark.gpu(devices=2)
@pytest.mark.parametrize("name", TENSOR_PARALLEL_NAMES)
def test_the_tensor_parallel_presets_train_validate_and_test_on_two_gpus(tensor_parallel_runs, measurements, name):
    run = tensor_parallel_runs[name]
    assert run.process.returncode == 0, run.output[-4000:]
    summary = run.summary
    assert (summary["world_size"], summary["global_step"]) == (2, 10)
    losses = read_train_losses(run.run_dir)
    assert losses[9] < losses[0], losses
    assert all(0 < summary["metrics"][key] < 1e4 for key in ("val_loss", "test_loss")), summary["metrics"]
    measurements["tensor_parallel"][name] = {"final_loss": losses[9], "val_loss": summary["metrics"]["val_loss"],
                                             "peak_cuda_bytes": max(p["bytes"] for p in summary["peak_memory_per_rank"])}
