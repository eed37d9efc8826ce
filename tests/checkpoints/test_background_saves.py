"""Background saves (`checkpoint.async=true`): the step stages a copy, a writer thread writes it beside its name and
swaps it in when whole; a failed write is raised at the next save under its name; DeepSpeed presets refuse it."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from lightning_dist.checkpoints.background import BackgroundSaves, BackgroundWriter, stage
from lightning_dist.checkpoints.swap import SaveFailed, SwappedSaves, partial_path
from tests.conftest import REPO


class _FileIO:
    """Lightning's CheckpointIO, made to wait for a gate and to fail on demand."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.fail = False

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.gate.wait(timeout=30)
        if self.fail:
            raise OSError("No space left on device")
        torch.save(checkpoint, path)

    def remove_checkpoint(self, path):
        Path(path).unlink()


class _OneRank:
    """What Lightning's single-rank strategy gives the mixins."""

    is_global_zero, global_rank, local_rank, world_size = True, 0, 0, 1

    def __init__(self) -> None:
        self.checkpoint_io = _FileIO()

    def broadcast(self, obj, src=0):
        return obj

    def barrier(self, name=None):
        pass

    def reduce_boolean_decision(self, decision, all=True):
        return decision

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):
        self.checkpoint_io.save_checkpoint(checkpoint, filepath)

    def remove_checkpoint(self, filepath):
        self.checkpoint_io.remove_checkpoint(filepath)

    def teardown(self):
        pass

    def on_train_end(self):
        pass


class _Strategy(BackgroundSaves, SwappedSaves, _OneRank):
    async_checkpoint = True


def test_the_step_gets_its_copy_back_before_the_write_and_the_name_appears_whole(tmp_path):
    strategy, weights = _Strategy(), torch.ones(4)
    final = tmp_path / "last.ckpt"
    strategy.save_checkpoint({"state_dict": {"w": weights}, "global_step": 1}, final)  # returns while the write waits
    weights.add_(1)  # training goes on: the copy being written is the state at the save
    assert not final.exists() and partial_path(final).parent == tmp_path
    strategy.checkpoint_io.gate.set()
    strategy.wait_for_checkpoints()
    saved = torch.load(final)
    assert saved["global_step"] == 1 and torch.equal(saved["state_dict"]["w"], torch.ones(4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # nothing partial left


def test_a_failed_write_keeps_the_previous_save_and_is_raised_at_the_next_save_of_its_name(tmp_path):
    strategy = _Strategy()
    final = tmp_path / "last.ckpt"
    strategy.checkpoint_io.gate.set()
    strategy.save_checkpoint({"global_step": 1}, final)
    strategy.wait_for_checkpoints()
    strategy.checkpoint_io.fail = True
    strategy.save_checkpoint({"global_step": 2}, final)  # fails in the background
    with pytest.raises(SaveFailed, match=rf"^saving the checkpoint {final} failed \(No space left on device\); "):
        strategy.save_checkpoint({"global_step": 3}, final)
    assert torch.load(final)["global_step"] == 1  # the previous save, whole
    assert not partial_path(final).exists()


def test_a_superseded_checkpoint_is_removed_only_after_the_saves_before_it(tmp_path):
    strategy = _Strategy()
    old, new = tmp_path / "step000002.ckpt", tmp_path / "step000004.ckpt"
    strategy.checkpoint_io.gate.set()
    strategy.save_checkpoint({"global_step": 2}, old)
    strategy.wait_for_checkpoints()
    strategy.checkpoint_io.gate.clear()
    strategy.save_checkpoint({"global_step": 4}, new)  # ModelCheckpoint saves the new best, then removes the old
    strategy.remove_checkpoint(old)
    assert old.exists()  # a kill now would leave the old one, not neither
    strategy.checkpoint_io.gate.set()
    strategy.teardown()  # the end of fit waits for the writes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step000004.ckpt"]


def test_a_superseded_checkpoint_stays_when_the_save_that_was_to_replace_it_failed(tmp_path):
    strategy = _Strategy()
    old, new = tmp_path / "step000005.ckpt", tmp_path / "step000010.ckpt"
    strategy.checkpoint_io.gate.set()
    strategy.save_checkpoint({"global_step": 5}, old)
    strategy.checkpoint_io.fail = True  # the disk is full by the next save
    strategy.save_checkpoint({"global_step": 10}, new)
    strategy.remove_checkpoint(old)  # queued behind the write that fails
    with pytest.raises(SaveFailed, match=rf"^saving the checkpoint {new} failed \(No space left on device\); "):
        strategy.finish_checkpoints()  # fit's end: the failure is raised there, not left to a teardown
    assert torch.load(old)["global_step"] == 5  # the top-k checkpoint, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step000005.ckpt"]


def test_the_writer_writes_in_the_order_saves_were_staged():
    writer, order = BackgroundWriter(), []
    for name in ("a", "b", "c"):
        writer.submit(Path(name), lambda name=name: order.append(name))
    writer.submit_after_writes(lambda: order.append("removal"))
    assert writer.close() is None and order == ["a", "b", "c", "removal"]


def test_staging_copies_nested_state_out_of_the_live_tensors():
    live = {"model": {"w": torch.arange(3.0)}, "optimizer": [{"exp_avg": torch.zeros(2)}], "step": 7}
    staged = stage(live)
    live["model"]["w"].mul_(10)
    live["optimizer"][0]["exp_avg"].add_(1)
    assert torch.equal(staged["model"]["w"], torch.arange(3.0))
    assert torch.equal(staged["optimizer"][0]["exp_avg"], torch.zeros(2))
    assert staged["step"] == 7


def train_refusal(*overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "train.py"), *overrides, f"hydra.run.dir={cwd}/run"], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_a_value_that_is_not_a_boolean_is_named_with_the_choices(tmp_path):
    process = train_refusal("checkpoint.async=maybe", cwd=tmp_path)
    assert process.returncode == 2
    assert "checkpoint.async" in process.stderr.strip().splitlines()[-1]
    assert "true or false" in process.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_ddp_run_saving_in_the_background_saves_what_a_synchronous_one_saves(curve_runs, tmp_path):
    from lightning_dist.reports.equivalence import run_strategy
    from tests.conftest import CURVE_OVERRIDES

    run = run_strategy("ddp", [*CURVE_OVERRIDES, "checkpoint.async=true"], tmp_path / "run")
    assert run.returncode == 0, run.output[-3000:]
    synchronous = curve_runs("ddp").run_dir / "checkpoints"
    names = sorted(p.name for p in (run.run_dir / "checkpoints").iterdir())
    assert names == sorted(p.name for p in synchronous.iterdir()) and "last.ckpt" in names
    for name in names:
        ours, theirs = (torch.load(directory / name, map_location="cpu", weights_only=False)
                        for directory in (run.run_dir / "checkpoints", synchronous))
        assert ours["global_step"] == theirs["global_step"]
        for key, tensor in theirs["state_dict"].items():
            assert torch.equal(ours["state_dict"][key], tensor), (name, key)
        for moment in ("exp_avg", "exp_avg_sq"):
            for index, state in theirs["optimizer_states"][0]["state"].items():
                assert torch.equal(ours["optimizer_states"][0]["state"][index][moment], state[moment]), (name, index)


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs (mounting needs root, as our machines and CI run): room for one checkpoint of the default
    model (10 MB) and the run's logs, not for a second checkpoint."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    assert mounted.returncode == 0, f"the full-disk test mounts a tmpfs: {mounted.stderr.strip()}"
    yield disk
    subprocess.run(["umount", "--lazy", str(disk)], check=True)


@pytest.mark.slow
def test_a_full_disk_keeps_the_checkpoint_it_was_to_replace_and_ends_every_rank_with_its_line(small_disk):
    from lightning_dist.checkpoints.whole import is_whole
    from tests.conftest import run_train

    # A save every 5 steps, the newest kept: step 10's write fails, and the removal of step 5 queued behind it with it.
    run = run_train(small_disk, "checkpoint.async=true", "callbacks.model_checkpoint.every_n_train_steps=5",
                    "callbacks.model_checkpoint.monitor=null", "callbacks.model_checkpoint.save_last=false",
                    "trainer.max_steps=12", "test=false")
    assert run.process.returncode == 1, run.output[-3000:]
    said = [line for line in run.output.splitlines() if line.startswith("error: ")]
    assert len(said) == 2, said  # each rank, with the same line: neither is killed by the other's exit
    assert all(line.startswith(f"error: saving the checkpoint {small_disk}/checkpoints/step000010.ckpt failed (")
               and "the disk is full: " in line for line in said), said
    assert "forcefully terminating" not in run.output
    checkpoints = small_disk / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step000005.ckpt"]
    assert is_whole(checkpoints / "step000005.ckpt")


def test_a_rank_that_does_not_commit_says_its_failed_background_write_in_one_line(tmp_path):
    from tests.checkpoints.test_swapped_saves import CheckpointException

    class _OtherRank(_Strategy):  # a sharded save's rank 1: it writes its shards, global rank 0 swaps them in
        is_global_zero, global_rank = False, 1

        def staged_write(self, checkpoint, partial):
            def write():
                raise CheckpointException("CheckpointException ranks:dict_keys([0, 1])\nTraceback (RANK 1)\n"
                                          "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704"
                                          " vs 598")
            return write

    strategy, final = _OtherRank(), tmp_path / "last"
    strategy.save_checkpoint({"global_step": 2}, final)
    with pytest.raises(SaveFailed) as failed:
        strategy.wait_for_checkpoints()
    assert str(failed.value).startswith(
        f"saving the checkpoint {final} failed (RuntimeError: [enforce fail at inline_container.cc:672] . unexpected"
        " pos 704 vs 598); ")
    assert "\n" not in str(failed.value)
