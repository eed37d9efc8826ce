"""The GPU suite's runs: each preset trains the default model on one CUDA device (world size 1, nccl).

The runs are independent processes on one GPU with a tiny model, so they go several at a time (the suite must fit
a lent machine's 10-minute command). What they measured is written as JSON to $LD_GPU_MEASUREMENTS, which
scripts/gpu_check.sh turns into the report.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import (
    PIPELINE_PARALLEL_NAMES,
    PRESET_NAMES,
    REPO,
    TENSOR_PARALLEL_NAMES,
    TRAIN_ENV,
    TrainRun,
    train_command,
)

# Fit, then test, as `python train.py` runs them: the sanity check, the validation at the last step and the test loop
# update the model's torchmetrics metrics (the first GPU run failed there under ZeRO-3: states left on the host).
GPU = ("trainer=gpu", "trainer.devices=1", "trainer.log_every_n_steps=1", "callbacks.progress_bar=null")
STEPS = 20
# Checkpoints every 10 steps (kept), for the resume tests; the probe model writes its gathered weights at the end.
FP32_RUN = (
    "trainer.precision=32-true", f"trainer.max_steps={STEPS}",
    "callbacks.model_checkpoint.every_n_train_steps=10", "callbacks.model_checkpoint.monitor=null",
    "callbacks.model_checkpoint.save_top_k=-1",
    "model._target_=tests.models.checkpoint_probe.CheckpointProbeGPT", "+model.gathered_path=${paths.output_dir}/gathered_state.pt",
)
# The precision matrix's CUDA cells that CPU runs cannot reach or refuse (docs/precision.md, lightning_dist/parallel/precision.py).
PRECISION_CELLS = [
    ("ddp", "bf16-mixed"), ("ddp", "16-mixed"),
    ("fsdp", "bf16-mixed"),
    ("deepspeed_stage_2", "bf16-mixed"), ("deepspeed_stage_2", "16-mixed"),
    ("deepspeed_stage_3", "bf16-mixed"), ("deepspeed_stage_3", "16-mixed"),
]
RESUMED = ["ddp", "fsdp", "deepspeed_stage_3"]
# Tensor parallelism over 2 GPUs of one node (data parallelism of 1): where 2 are visible.
TENSOR_PARALLEL_RUN = ("trainer=gpu", "trainer.devices=2", "trainer.max_steps=10", "trainer.log_every_n_steps=1",
                       "callbacks.progress_bar=null")
NVME = "deepspeed_stage_3_offload_nvme"
# One GPU: no tensor-parallel group and no pipeline of 2 stages fits it (the H200 run of 2026-12-04 refused them).
# NVMe offload has a test of its own: the machine may lack libaio's headers.
ONE_DEVICE_NAMES = [name for name in PRESET_NAMES
                    if name not in TENSOR_PARALLEL_NAMES + PIPELINE_PARALLEL_NAMES and name != NVME]
PARALLEL = int(os.environ.get("LD_GPU_PARALLEL", "8"))


def run_many(jobs: dict[str, tuple[Path, list[str]]], parallel: int = PARALLEL, timeout: float = 540) -> dict[str, TrainRun]:
    """Start `train.py` for every job, `parallel` at a time; {name: TrainRun} once all have finished."""
    pending, running, done = list(jobs.items()), {}, {}
    while pending or running:
        while pending and len(running) < parallel:
            name, (run_dir, overrides) = pending.pop(0)
            running[name] = (run_dir, subprocess.Popen(train_command(run_dir, *overrides), cwd=REPO, env=TRAIN_ENV,
                                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        name = next(iter(running))
        run_dir, process = running.pop(name)
        stdout, stderr = process.communicate(timeout=timeout)
        done[name] = TrainRun(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr), run_dir)
    return done


@pytest.fixture(scope="session")
def measurements():
    """What the suite measured, by section; written to $LD_GPU_MEASUREMENTS after every test that adds to it, so that
    a suite stopped at its time limit still reports what it measured (on the H200 of 2026-12-04 it lost them all)."""
    return {"fp32": {}, "precision": {}, "resume": {}, "consolidated": {}, "tensor_parallel": {}, "qlora": {}}


@pytest.fixture(autouse=True)
def _write_measurements(measurements):
    yield
    if os.environ.get("LD_GPU_MEASUREMENTS"):
        Path(os.environ["LD_GPU_MEASUREMENTS"]).write_text(json.dumps(measurements, indent=2))


@pytest.fixture(scope="session")
def fp32_runs(tmp_path_factory) -> dict[str, TrainRun]:
    jobs = {}
    for name in ONE_DEVICE_NAMES:
        run_dir = tmp_path_factory.mktemp(f"fp32_{name}")
        jobs[name] = (run_dir, [f"strategy={name}", *GPU, *FP32_RUN])
    return run_many(jobs)


@pytest.fixture(scope="session")
def precision_runs(tmp_path_factory) -> dict[tuple[str, str], TrainRun]:
    jobs = {
        f"{name}|{precision}": (tmp_path_factory.mktemp(f"{name}_{precision}"),
                                [f"strategy={name}", *GPU, f"trainer.precision={precision}", "trainer.max_steps=10"])
        for name, precision in PRECISION_CELLS
    }
    return {tuple(key.split("|")): run for key, run in run_many(jobs).items()}


@pytest.fixture(scope="session")
def resumed_runs(tmp_path_factory, fp32_runs) -> dict[str, TrainRun]:
    """Each family's fp32 run resumed from its own step-10 checkpoint, to step 20 again."""
    jobs = {}
    for name in RESUMED:
        checkpoint = fp32_runs[name].run_dir / "checkpoints" / "step000010.ckpt"
        jobs[name] = (tmp_path_factory.mktemp(f"resumed_{name}"), [f"strategy={name}", *GPU, *FP32_RUN, f"ckpt_path={checkpoint}"])
    return run_many(jobs)


@pytest.fixture(scope="session")
def tensor_parallel_runs(tmp_path_factory) -> dict[str, TrainRun]:
    return run_many({name: (tmp_path_factory.mktemp(f"tp_{name}"), [f"strategy={name}", *TENSOR_PARALLEL_RUN])
                     for name in TENSOR_PARALLEL_NAMES}, parallel=1)
