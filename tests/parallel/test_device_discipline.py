"""Every tensor a collective sees lives on the strategy's root device: checked on CPU, where NCCL cannot refuse.

A run of the real train() in this process (world size 1, gloo) under the instruments of tests/device_discipline.py:
tensors made by the package without `device=` land on the meta device (the root device stays the CPU, so the two
differ as they do on a GPU rank), and every c10d collective, whoever issues it, must get root-device tensors only.
The runs cover the callbacks on by default (run summary, training monitor with module location, checkpoints), the
checkpoint gather helper (the probe model gathers its weights), gradient clipping, a sharded strategy with host
state (FSDP CPU offload), ZeRO-3, and resuming from a foreign checkpoint (consolidation, optimizer state by name).
"""

from __future__ import annotations

import os

import pytest
import torch
from hydra import compose, initialize_config_dir

from lightning_dist.run.train import train
from tests.conftest import CONF_DIR
from tests.device_discipline import CarelessTensorsOnMeta, CollectiveDeviceAudit
from tests.probes import StepClock

pytestmark = pytest.mark.slow

CHECK_EVERY = 3
RUN = (
    "trainer.devices=1", "trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.limit_val_batches=1",
    "trainer.num_sanity_val_steps=1", "trainer.log_every_n_steps=1", "trainer.gradient_clip_val=1.0",
    "callbacks.model_checkpoint.every_n_train_steps=3", "callbacks.model_checkpoint.monitor=null",
    "callbacks.model_checkpoint.save_top_k=-1", "callbacks.progress_bar=null",
    "callbacks.training_monitor.locate_module=true", f"callbacks.training_monitor.check_every_n_steps={CHECK_EVERY}",
    "+callbacks.clock._target_=tests.probes.StepClock",
    "model._target_=tests.models.checkpoint_probe.CheckpointProbeGPT", "+model.gathered_path=${paths.output_dir}/gathered_state.pt",
    "data.batch_size=4",
)


class AuditedRun:
    def __init__(self, run_dir, careless: CarelessTensorsOnMeta, audit: CollectiveDeviceAudit, metrics=None, error=None):
        self.run_dir, self.careless, self.audit, self.metrics, self.error = run_dir, careless, audit, metrics, error
        self.environment_after = dict(os.environ)


def audited_train(run_dir, *overrides: str, packages: tuple[str, ...] = ("lightning_dist",)) -> AuditedRun:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"paths.output_dir={run_dir}", *RUN, *overrides])
    environment_before = dict(os.environ)
    careless = CarelessTensorsOnMeta(packages=packages, step=lambda: StepClock.current)
    audit = CollectiveDeviceAudit(torch.device("cpu"))
    try:
        with careless, audit:
            run = AuditedRun(run_dir, careless, audit, metrics=train(cfg))
    except Exception as error:  # the test reads it
        run = AuditedRun(run_dir, careless, audit, error=error)
    run.environment_before = environment_before
    return run


@pytest.fixture(scope="module")
def audited_runs(tmp_path_factory, deepspeed_ops) -> dict[str, AuditedRun]:
    runs = {}
    for name in ("ddp", "fsdp_cpu_offload", "deepspeed_stage_3"):
        runs[name] = audited_train(tmp_path_factory.mktemp(name), f"strategy={name}")
    zero3_checkpoint = runs["deepspeed_stage_3"].run_dir / "checkpoints" / "last.ckpt"
    for name in ("ddp", "fsdp"):  # consolidated on load, Adam state restored by parameter name
        runs[f"{name}_from_zero3"] = audited_train(
            tmp_path_factory.mktemp(f"{name}_from_zero3"), f"strategy={name}", f"ckpt_path={zero3_checkpoint}", "trainer.max_steps=9"
        )
    return runs


RUN_NAMES = ["ddp", "fsdp_cpu_offload", "deepspeed_stage_3", "ddp_from_zero3", "fsdp_from_zero3"]


@pytest.mark.parametrize("name", RUN_NAMES)
def test_every_collective_gets_root_device_tensors_and_the_package_makes_none_elsewhere(audited_runs, name):
    run = audited_runs[name]
    assert run.error is None, repr(run.error)
    assert run.audit.violations == []
    assert run.careless.redirected == []
    assert run.metrics["test_loss"] < run.metrics["val_loss"] + 1  # it trained and tested: real numbers came back
    assert (run.run_dir / "gathered_state.pt").exists()


@pytest.mark.parametrize("name", RUN_NAMES)
def test_a_run_in_this_process_leaves_no_rank_or_address_behind(audited_runs, name):
    """A process this one starts later (the next job, a notebook's next run) must not inherit this run's rank:
    Lightning's DeepSpeed set-up writes RANK, and Lightning reads RANK before SLURM_PROCID."""
    run = audited_runs[name]
    launch = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
    assert {k: run.environment_after.get(k) for k in launch} == {k: run.environment_before.get(k) for k in launch}


@pytest.mark.parametrize("name", RUN_NAMES)
def test_the_audit_saw_the_packages_own_collectives(audited_runs, name):
    seen = set(audited_runs[name].audit.seen)
    # The run summary's object gathers and its per-rank count, and the monitor's finiteness check.
    assert "c10d::allgather_" in seen and "c10d::_allgather_base_" in seen, sorted(seen)


@pytest.mark.parametrize("name", ["ddp", "fsdp_cpu_offload", "deepspeed_stage_3"])
def test_the_monitor_reads_from_the_device_only_at_its_checks(audited_runs, name):
    """No host synchronisation per step: the package reads device values on the host only where the monitor
    compares notes (every CHECK_EVERY steps: before backward, and after the gradient norm)."""
    reads = [(step, where) for step, where in audited_runs[name].careless.host_reads if step is not None]
    steps = sorted({step for step, _ in reads})
    assert steps == [CHECK_EVERY - 1, 2 * CHECK_EVERY - 1], reads
    assert all("lightning_dist.parallel.devices" in where for _, where in reads), reads


def test_the_instruments_catch_a_count_gathered_from_a_host_tensor(tmp_path):
    """RunSummary's old mistake, `all_gather(torch.tensor(count))`, made by a callback the instruments watch."""
    run = audited_train(tmp_path, "strategy=ddp", "trainer.max_steps=2", "+callbacks.careless._target_=tests.probes.CarelessGather",
                        packages=("lightning_dist", "tests.probes"))
    assert [where for where in run.careless.redirected if where.startswith("tensor at tests.probes:")] != []
    assert isinstance(run.error, AssertionError)
    assert run.audit.violations == ["c10d::allgather_ got tensors on meta"]
