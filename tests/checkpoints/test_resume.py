"""Auto-resume after an interrupted run, and checkpoint retention for directory checkpoints."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest
import torch

from lightning_dist.reports.equivalence import read_train_losses
from tests.conftest import REPO, in_the_suite, run_train

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
    # The run was cut off while saving step 15: the file stops half-way. And `last` is, newest of all, another
    # model's: a wider embedding (a user who changed model.d_model and copied a checkpoint in, say).
    data = (checkpoints / "step000015.ckpt").read_bytes()
    (checkpoints / "step000015.ckpt").write_bytes(data[: len(data) // 3])
    other = torch.load(checkpoints / "step000010.ckpt", weights_only=False)
    name, weight = next(iter(other["state_dict"].items()))
    other["state_dict"][name] = torch.zeros(weight.shape[0] + 1, *weight.shape[1:])
    (checkpoints / "last.ckpt").unlink()
    torch.save(other, checkpoints / "last.ckpt")

    again = run_in(tmp_path, *EVERY_5_STEPS, "resume=true")
    assert again.returncode == 0, again.stderr[-3000:]
    said = again.stdout + again.stderr
    assert (f"resume=true: passed over {checkpoints / 'last.ckpt'}: holds another model's weights: 1 have other shapes"
            f" (e.g. {name} is {[weight.shape[0] + 1, *weight.shape[1:]]} there and {list(weight.shape)} in this model)"
            in said), said[-3000:]
    assert f"resume=true: passed over {checkpoints / 'step000015.ckpt'}: its save did not finish" in said
    assert f"resume=true: resuming from {checkpoints / 'step000010.ckpt'}" in said
    resumed_dir = next(d for d in (tmp_path / "train" / "runs").iterdir() if d != run_dir)
    original, resumed = read_train_losses(run_dir), read_train_losses(resumed_dir)
    assert sorted(resumed) == [10, 11, 12, 13, 14]
    assert all(resumed[step] == pytest.approx(original[step], rel=1e-6) for step in resumed)
    assert (checkpoints / "step000010.ckpt").exists()  # nothing of the earlier run was touched


def test_resume_switch_without_an_earlier_run_starts_afresh(tmp_path):
    process = run_in(tmp_path, "trainer.max_steps=2", "test=false", "resume=true")
    assert process.returncode == 0
    assert "no earlier complete checkpoint of this command; starting afresh" in process.stdout + process.stderr


@pytest.mark.parametrize("strategy", in_the_suite(["deepspeed_stage_2", "fsdp"], ["fsdp"]))
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


def test_a_finished_run_continued_to_more_steps_reads_on_where_its_data_stopped(tmp_path):
    """Stopped by max_steps mid-epoch, a run's last checkpoint is written after Lightning counted the epoch
    completed; continued with a larger max_steps (twice, across two epoch ends), it reads the rest of that epoch's
    data and trains the uninterrupted run's losses. It read the next epoch's order instead (4.4418 for 4.4150). Each
    step is logged in the uninterrupted run's epoch: the continued run finishes the stopped epoch (Lightning's own
    resume numbered it one epoch on)."""
    short = ("trainer.devices=2", "data.val_fraction=0.9", "test=false", "trainer.log_every_n_steps=1",
             "trainer.limit_val_batches=0", "trainer.num_sanity_val_steps=0", "callbacks.model_checkpoint.monitor=null")
    whole = run_train(tmp_path / "whole", *short, "trainer.max_steps=16")
    assert whole.process.returncode == 0, whole.output[-3000:]
    previous, losses, epochs = None, {}, {}
    for name, steps in (("first", 5), ("more", 9), ("most", 16)):
        resume = (f"ckpt_path={tmp_path / previous / 'checkpoints' / 'last.ckpt'}",) if previous else ()
        run = run_train(tmp_path / name, *short, f"trainer.max_steps={steps}", *resume)
        assert run.process.returncode == 0, run.output[-3000:]
        losses |= read_train_losses(run.run_dir)
        epochs |= epochs_of_steps(run.run_dir)
        previous = name
    assert set(epochs_of_steps(whole.run_dir).values()) == {0, 1, 2}  # 7 steps an epoch at 2 ranks: the continued
    assert epochs == epochs_of_steps(whole.run_dir)  # runs cross both epoch ends
    assert sorted(losses) == list(range(16))
    assert losses == pytest.approx(read_train_losses(whole.run_dir), abs=1e-6)


def epochs_of_steps(run_dir) -> dict[int, int]:
    """{step: epoch} of the rows metrics.csv logged a train loss in."""
    rows = csv.DictReader((run_dir / "csv" / "metrics.csv").open())
    return {int(row["step"]): int(row["epoch"]) for row in rows if row.get("train_loss")}


def test_a_run_bounded_by_epochs_continued_to_more_epochs_reads_the_next_epoch(tmp_path):
    """A run of 1 epoch continued to 2 (`trainer.max_epochs=2 ckpt_path=.../last.ckpt`) trains epoch 1 as the
    uninterrupted 2-epoch run did, from the checkpoint saved after the run's last epoch as written now and as written
    before (the data's state with Lightning's `current_epoch`, one on). It stopped at once: `ValueError: __len__()
    should return >= 0` (the data module skipped the whole finished epoch again)."""
    short = ("trainer.devices=2", "data.val_fraction=0.9", "test=false", "trainer.log_every_n_steps=1",
             "trainer.max_steps=-1", "trainer.limit_val_batches=0", "trainer.num_sanity_val_steps=0",
             "callbacks.model_checkpoint.monitor=null")
    whole = run_train(tmp_path / "whole", *short, "trainer.max_epochs=2")
    first = run_train(tmp_path / "first", *short, "trainer.max_epochs=1")
    assert whole.process.returncode == 0 and first.process.returncode == 0, whole.output[-3000:] + first.output[-3000:]
    last = torch.load(first.run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["PydocTextDataModule"] == {"epoch": 0, "samples_done": 192, "lightning_epoch": 0}
    last["PydocTextDataModule"] = {"epoch": 0, "samples_done": 192, "trainer_epoch": 1}  # as written before
    torch.save(last, tmp_path / "written_before.ckpt")
    expected = read_train_losses(whole.run_dir)
    assert set(epochs_of_steps(whole.run_dir).values()) == {0, 1}
    for name, checkpoint in (("more", first.run_dir / "checkpoints" / "last.ckpt"),
                             ("more_from_before", tmp_path / "written_before.ckpt")):
        more = run_train(tmp_path / name, *short, "trainer.max_epochs=2", f"ckpt_path={checkpoint}")
        assert more.process.returncode == 0, more.output[-3000:]
        losses = read_train_losses(first.run_dir) | read_train_losses(more.run_dir)
        assert losses == pytest.approx(expected, abs=1e-6)
        assert epochs_of_steps(first.run_dir) | epochs_of_steps(more.run_dir) == epochs_of_steps(whole.run_dir)
