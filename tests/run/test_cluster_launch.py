"""Beyond one interpreter: torchrun with two node ranks, SLURM (simulated here), the submitit launchers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.trainer.call import _call_and_handle_interrupt
from omegaconf import OmegaConf

import lightning_dist  # noqa: F401  (registers the ld_* names)
from lightning_dist.run.config_check import ConfigError, check_launcher
from tests.conftest import CONF_DIR, REPO

SLURM_RANK_3_OF_4 = {
    "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
    "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train", "SLURM_NODELIST": "node[01-02]", "SLURM_JOB_NODELIST": "node[01-02]",
}


@pytest.fixture
def restored_environment():
    """Lightning's SLURM environment writes MASTER_ADDR/MASTER_PORT into os.environ; later tests' runs must not
    inherit node01 as their rendezvous address."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("name", ["ld_ddp", "ld_fsdp", "ld_deepspeed_stage_2"])
def test_under_slurm_the_strategy_reads_ranks_from_slurm_and_spawns_nothing(name, monkeypatch, restored_environment):
    for key, value in SLURM_RANK_3_OF_4.items():
        monkeypatch.setenv(key, value)
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, num_nodes=2, logger=False)
    strategy = trainer.strategy
    assert isinstance(strategy.cluster_environment, SLURMEnvironment)
    assert strategy.cluster_environment.creates_processes_externally
    assert (trainer.global_rank, trainer.local_rank, trainer.node_rank, trainer.world_size) == (3, 1, 1, 4)
    assert strategy.cluster_environment.main_address == "node01"
    # The way Trainer.fit enters its launcher (FSDP has none under SLURM; DDP's and DeepSpeed's do not spawn).
    spawned = []
    monkeypatch.setattr(subprocess, "Popen", lambda *args, **kwargs: spawned.append(args))
    monkeypatch.setattr(torch.multiprocessing, "start_processes", lambda *args, **kwargs: spawned.append(args))
    ran_in = _call_and_handle_interrupt(trainer, os.getpid)
    assert (ran_in, spawned) == (os.getpid(), [])


def resolved_launcher(cfg) -> dict:
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().set_config(cfg)  # the launcher's paths interpolate ${hydra:...}, as in a real sweep
    try:
        return OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    finally:
        HydraConfig.instance().cfg = None


def test_slurm_launcher_config_maps_devices_to_tasks():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["hydra/launcher=slurm", "trainer=gpu", "trainer.devices=4", "trainer.num_nodes=2"],
                      return_hydra_config=True)
    launcher = resolved_launcher(cfg)
    assert launcher["_target_"] == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (launcher["nodes"], launcher["tasks_per_node"], launcher["gpus_per_node"]) == (2, 4, 4)


@pytest.mark.parametrize(("devices", "per_node"), [("8", 8), ("[0,1,2]", 3), ("'0,1'", 2)])
def test_slurm_launcher_with_the_gpu_trainer_gets_integer_tasks_and_gpus_per_node(devices, per_node):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["hydra/launcher=slurm", "trainer=gpu", f"trainer.devices={devices}"], return_hydra_config=True)
    launcher = resolved_launcher(cfg)
    assert (launcher["nodes"], launcher["tasks_per_node"], launcher["gpus_per_node"]) == (1, per_node, per_node)


@pytest.mark.parametrize("devices", [None, "-1"])
def test_slurm_launcher_refuses_devices_it_cannot_count_in_one_line(devices):
    overrides = ["hydra/launcher=slurm", "trainer=gpu", "strategy=fsdp,deepspeed_stage_3"]  # trainer=gpu: devices=auto
    if devices is not None:
        overrides.append(f"trainer.devices={devices}")
    with pytest.raises(ConfigError) as error:
        check_launcher(overrides)
    assert str(error.value) == (
        f"hydra.launcher.tasks_per_node: trainer.devices={devices or 'auto'}: a SLURM job is sized before it reaches its"
        " nodes, so it cannot use auto or -1; set trainer.devices=N, the GPUs per node (one task each)"
    )


def test_a_slurm_sweep_with_devices_auto_stops_before_submitting_anything(tmp_path):
    process = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "-m", "hydra/launcher=slurm", "trainer=gpu", "strategy=fsdp,ddp",
         f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert process.returncode == 2
    assert process.stderr.strip().splitlines() == [
        "error: hydra.launcher.tasks_per_node: trainer.devices=auto: a SLURM job is sized before it reaches its nodes,"
        " so it cannot use auto or -1; set trainer.devices=N, the GPUs per node (one task each)"
    ]
    assert not (tmp_path / "sweep").exists()


def test_local_launcher_config_runs_one_task_per_job():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["hydra/launcher=local"], return_hydra_config=True)
    launcher = resolved_launcher(cfg)
    assert launcher["_target_"] == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"
    assert (launcher["nodes"], launcher["tasks_per_node"]) == (1, 1)


@pytest.mark.slow
def test_submitit_local_launcher_runs_a_two_job_sweep(tmp_path, deepspeed_ops):
    sweep_dir = tmp_path / "multirun"
    env = {**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning", "PYTHONPATH": str(REPO)}
    process = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "-m", "hydra/launcher=local", "strategy=ddp,deepspeed_stage_2",
         "trainer.max_steps=4", "test=false", f"hydra.sweep.dir={sweep_dir}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )
    assert process.returncode == 0, process.stderr[-4000:]
    assert "Submitit 'local' sweep output dir" in process.stdout + process.stderr
    strategies = [json.loads((sweep_dir / job / "metrics.json").read_text())["strategy"] for job in ("0", "1")]
    assert strategies == ["DDPStrategy", "DeepSpeedStrategy"]
    for job in ("0", "1"):
        summary = json.loads((sweep_dir / job / "metrics.json").read_text())
        assert (summary["world_size"], summary["train_batches_per_rank"]) == (2, [4, 4])
    assert len(list((sweep_dir / ".submitit").glob("*/*_result.pkl"))) == 2  # submitit ran both jobs and kept results


@pytest.mark.parametrize(("devices", "num_nodes", "isolated"), [
    (2, 1, True), ("auto", 1, True), (-1, 1, True), (1, 2, True), ([0, 1], 1, True),
    (1, 1, False), ("1", 1, False), ([0], 1, False),
])
def test_a_sweep_job_gets_its_own_process_when_lightning_would_start_ranks(devices, num_nodes, isolated):
    from types import SimpleNamespace

    from hydra.types import RunMode

    from lightning_dist.run.isolated_job import needs_isolation

    trainer = {"devices": devices, "num_nodes": num_nodes}
    assert needs_isolation(SimpleNamespace(mode=RunMode.MULTIRUN), trainer) is isolated
    assert needs_isolation(SimpleNamespace(mode=RunMode.RUN), trainer) is False
