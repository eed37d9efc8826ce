"""Auto-resume after an interrupted run, and checkpoint retention for directory checkpoints."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lightning_dist.equivalence import read_train_losses
from tests.conftest import REPO, run_train

pytestmark = pytest.mark.slow

EVERY_5_STEPS = (
    "trainer.max_steps=15", "trainer.log_every_n_steps=1", "test=false",
    "callbacks.model_checkpoint.every_n_train_steps=5", "callbacks.model_checkpoint.save_top_k=-1",
    "callbacks.model_checkpoint.monitor=null",
)


def run_in(log_dir, *overrides) -> subprocess.CompletedProcess:
    """train.py with the default run-directory layout under `log_dir`, which auto-resume searches."""
    command = [sys.executable, str(REPO / "train.py"), f"paths.log_dir={log_dir}", *overrides]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_resume_switch_continues_from_the_newest_complete_checkpoint(tmp_path):
    first = run_in(tmp_path, *EVERY_5_STEPS)
    assert first.returncode == 0, first.stderr[-3000:]
    (run_dir,) = (tmp_path / "train" / "runs").iterdir()
    checkpoints = run_dir / "checkpoints"
    # The run was cut off while saving step 15: the file (and `last`) stop half-way.
    for name in ("step000015.ckpt", "last.ckpt"):
        data = (checkpoints / name).read_bytes()
        (checkpoints / name).write_bytes(data[: len(data) // 3])

    again = run_in(tmp_path, *EVERY_5_STEPS, "resume=true")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resume=true: resuming from {checkpoints / 'step000010.ckpt'}" in again.stdout + again.stderr
    resumed_dir = next(d for d in (tmp_path / "train" / "runs").iterdir() if d != run_dir)
    original, resumed = read_train_losses(run_dir), read_train_losses(resumed_dir)
    assert sorted(resumed) == [10, 11, 12, 13, 14]
    assert all(resumed[step] == pytest.approx(original[step], rel=1e-6) for step in resumed)
    assert (checkpoints / "step000010.ckpt").exists()  # nothing of the earlier run was touched


def test_resume_switch_without_an_earlier_run_starts_afresh(tmp_path):
    process = run_in(tmp_path, "trainer.max_steps=2", "test=false", "resume=true")
    assert process.returncode == 0
    assert "no earlier complete checkpoint of this command; starting afresh" in process.stdout + process.stderr


@pytest.mark.parametrize("strategy", ["deepspeed_stage_2", "fsdp"])
def test_save_top_k_keeps_exactly_two_directory_checkpoints_plus_last(strategy, tmp_path, deepspeed_ops):
    run = run_train(
        tmp_path, f"strategy={strategy}", "trainer.max_steps=20", "test=false",
        "callbacks.model_checkpoint.every_n_train_steps=5", "callbacks.model_checkpoint.save_top_k=2",
        "callbacks.model_checkpoint.monitor=train_loss",
    )
    assert run.process.returncode == 0, run.output[-3000:]
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert len(kept) == 3 and "last.ckpt" in kept, kept
    assert all((tmp_path / "checkpoints" / name).is_dir() for name in kept)
