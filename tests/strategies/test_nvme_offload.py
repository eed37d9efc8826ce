"""ZeRO-Infinity on CPU: `deepspeed_stage_3_offload_nvme` with a local directory standing in for the NVMe drive."""

from __future__ import annotations

import json
import time

import pytest

from tests.callbacks.test_host_syncs import host_syncs_per_rank, unexplained
from tests.conftest import needs_libaio, run_train

pytestmark = [pytest.mark.slow, needs_libaio]


@pytest.fixture(scope="module")
def nvme_run(tmp_path_factory, nvme_ops):
    nvme = tmp_path_factory.mktemp("nvme")
    run = run_train(
        tmp_path_factory.mktemp("nvme-run"), "strategy=deepspeed_stage_3_offload_nvme", f"strategy.nvme_path={nvme}",
        "trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=10", "test=false",
        "+callbacks.nvme_probe._target_=tests.probes.DirectoryProbe", f"+callbacks.nvme_probe.directory={nvme}",
        "+callbacks.nvme_probe.path=${paths.output_dir}/nvme_files.json",
        # `last` is saved twice: DeepSpeed's copy of the offloaded tensors refuses to write over a directory.
        "callbacks.model_checkpoint.every_n_train_steps=5", "callbacks.model_checkpoint.monitor=null",
        "callbacks.model_checkpoint.save_top_k=-1", "callbacks=[default,host_syncs]",
    )
    return run


def test_trains_with_the_engine_offloading_to_nvme(nvme_run):
    assert nvme_run.process.returncode == 0, nvme_run.output[-3000:]
    assert nvme_run.summary["train_batches_per_rank"] == [10, 10]
    for rank in nvme_run.summary["placement_per_rank"]:
        assert rank["offload"] == {"optimizer": "nvme", "parameters": "nvme"}
        assert rank["parameters_local"] * 2 == rank["parameters_total"]
    losses = nvme_run.val_losses()
    assert losses[max(losses)] < losses[0] - 0.3, losses


def test_quiet_steps_read_only_what_zero3_offload_reads_by_design(nvme_run):
    """tests/callbacks/test_host_syncs.py's check, for the one preset its runs leave out: swapping to NVMe adds no
    read on the host to ZeRO-3 offload's (its optimizer's step, on the host, waits for the files anyway)."""
    for report in host_syncs_per_rank(nvme_run.run_dir):
        assert len(report["quiet_steps"]) == 8, report["steps"]  # 10 steps: the 5th and the 10th log and save
        assert unexplained("deepspeed_stage_3_offload", report) == []


def test_optimizer_state_is_in_files_in_the_directory_during_training(nvme_run):
    files = json.loads((nvme_run.run_dir / "nvme_files.json").read_text())
    for rank in (0, 1):
        # fp32 master weights, exp_avg and exp_avg_sq: one file each for the rank's half of the 786,432 weight-decayed
        # matrix parameters (the embedding, biases and norms are small: ZeRO-3 keeps them whole on every rank).
        swapped = {name: size for name, size in files.items() if name.startswith(f"zero_stage_3/optimizer/rank{rank}/")}
        assert len(swapped) == 3, files
        assert set(swapped.values()) == {786_432 // 2 * 4}, swapped


@pytest.mark.parametrize("problem", ["missing", "a file"])
def test_unusable_directory_is_refused_before_any_rank_starts(tmp_path, problem):
    nvme = tmp_path / "nvme"
    if problem == "a file":
        nvme.write_text("not a directory")
    start = time.monotonic()
    run = run_train(tmp_path / "run", "strategy=deepspeed_stage_3_offload_nvme", f"strategy.nvme_path={nvme}",
                    "trainer.accelerator=cpu", "trainer.devices=2")
    assert time.monotonic() - start < 60
    assert run.process.returncode == 2
    last_line = run.process.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: offload cannot start: zero_optimization.offload_optimizer.nvme_path=")
    assert f"nvme_path={nvme}: no such directory" in last_line
    assert not (tmp_path / "run" / "train_ddp_process_1.log").exists()


def test_last_is_saved_again_whole_and_resumes(nvme_run, tmp_path):
    checkpoints = nvme_run.run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt", "step000005.ckpt", "step000010.ckpt"]
    assert (checkpoints / "last.ckpt" / "latest").read_text().strip() == "checkpoint"
    assert nvme_run.summary["global_step"] == 10
    resumed = run_train(
        tmp_path / "resumed", "strategy=deepspeed_stage_3_offload_nvme", f"strategy.nvme_path={tmp_path}",
        "trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=12", "test=false",
        f"ckpt_path={checkpoints / 'last.ckpt'}",
    )
    assert resumed.process.returncode == 0, resumed.output[-3000:]
    assert (resumed.summary["global_step"], resumed.summary["train_batches_per_rank"]) == (12, [2, 2])
