"""Beyond one interpreter: SLURM (simulated here) and the submitit launchers' configs."""

from __future__ import annotations

import os

import lightning as L
import pytest
from hydra import compose, initialize_config_dir
from lightning.fabric.plugins.environments import SLURMEnvironment
from omegaconf import OmegaConf

import lightning_dist  # noqa: F401  (registers the ld_* names)
from tests.conftest import CONF_DIR

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
    if strategy.launcher is None:  # FSDP: Lightning runs the job in this process, with no launcher at all
        return
    calls = []
    strategy.launcher.launch(lambda: calls.append("ran in this process"), trainer=trainer)
    assert calls == ["ran in this process"]
    assert strategy.launcher.procs == []  # nothing spawned


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


def test_local_launcher_config_runs_one_task_per_job():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["hydra/launcher=local"], return_hydra_config=True)
    launcher = resolved_launcher(cfg)
    assert launcher["_target_"] == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"
    assert (launcher["nodes"], launcher["tasks_per_node"]) == (1, 1)
