"""Saves are written beside their name and swapped in whole: a save cut off midway leaves the previous one intact."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_dist.checkpoints.swap import partial_path, write_then_swap

ONE_RANK = SimpleNamespace(local_rank=0, is_global_zero=True, world_size=1, barrier=lambda *args: None)


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_a_file_is_replaced_whole(tmp_path):
    final = tmp_path / "last.ckpt"
    final.write_text("step 5")
    write_then_swap(ONE_RANK, final, lambda path: path.write_text("step 10"))
    assert final.read_text() == "step 10" and leftovers(tmp_path) == []


def test_a_save_cut_off_midway_leaves_the_previous_one_and_the_next_save_cleans_up(tmp_path):
    final = tmp_path / "last.ckpt"
    final.write_text("step 5")

    def killed(path: Path) -> None:
        path.write_text("step 1")  # half written, then the process dies
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_then_swap(ONE_RANK, final, killed)
    assert final.read_text() == "step 5" and leftovers(tmp_path) == [".last.ckpt.partial"]
    write_then_swap(ONE_RANK, final, lambda path: path.write_text("step 15"))
    assert final.read_text() == "step 15" and leftovers(tmp_path) == []


def test_a_directory_of_shards_is_replaced_whole(tmp_path):
    final = tmp_path / "last.ckpt"
    final.mkdir()
    (final / "old_shard").write_text("old")

    def write_shards(path: Path) -> None:
        path.mkdir()
        (path / "shard_0").write_text("new")

    write_then_swap(ONE_RANK, final, write_shards)
    assert sorted(p.name for p in final.iterdir()) == ["manifest.json", "shard_0"] and leftovers(tmp_path) == []
    assert partial_path(final) == tmp_path / ".last.ckpt.partial"


class CheckpointException(BaseException):
    """As torch.distributed.checkpoint's: a BaseException, each rank's traceback under one first line."""


@pytest.mark.parametrize("raised", [
    OSError(28, "No space left on device"),
    CheckpointException("CheckpointException ranks:dict_keys([0, 1])\nTraceback (RANK 0)\n"
                        "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
])
def test_a_failed_save_removes_its_part_and_says_the_space_left(tmp_path, raised, monkeypatch):
    import shutil

    from lightning_dist.checkpoints.swap import SaveFailed

    final = tmp_path / "last.ckpt"
    final.write_text("step 5")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=8 << 30, free=1 << 20))

    def disk_full(path: Path) -> None:
        path.mkdir()
        (path / "__0_0.distcp").write_bytes(b"x" * 1000)
        raise raised

    with pytest.raises(SaveFailed) as failed:
        write_then_swap(ONE_RANK, final, disk_full)
    reason = "[Errno 28] No space left on device" if isinstance(raised, OSError) else "RuntimeError: [enforce fail at"
    assert str(failed.value).startswith(f"saving the checkpoint {final} failed ({reason}")
    assert str(failed.value).endswith(f"; the disk is full: 1.0 MiB free of 8.0 GiB on the file system of {tmp_path}")
    assert final.read_text() == "step 5" and leftovers(tmp_path) == []


def test_only_global_rank_0_removes_a_cut_off_saves_leftover(tmp_path):
    # Node 1's local rank 0 on storage node 0 shares: were it to remove the leftover too, the two removals would
    # race, and one would fail on the files the other removed first (tests/run/test_two_nodes.py runs it).
    final = tmp_path / "last.ckpt"
    leftover = partial_path(final)
    leftover.mkdir()
    (leftover / "__1_0.distcp").write_text("a shard of a save cut off")
    seen = []
    node_1 = SimpleNamespace(local_rank=0, is_global_zero=False, world_size=1, barrier=lambda *args: None)
    write_then_swap(node_1, final, lambda path: seen.append(sorted(p.name for p in path.iterdir())))
    assert seen == [["__1_0.distcp"]] and not final.exists()  # neither removed nor swapped in: global rank 0's part
    write_then_swap(ONE_RANK, final, lambda path: (seen.append(path.exists()), path.write_text("step 2")))
    assert seen[1] is False and final.read_text() == "step 2"  # global rank 0 removed it, wrote and swapped


@pytest.mark.parametrize("strategy", ["DDPStrategy", "FSDPStrategy"])
def test_a_file_checkpoint_is_written_once_straight_into_its_partial_path(strategy, tmp_path, monkeypatch):
    import tempfile

    import torch

    import lightning_dist.strategies as strategies

    def staged(*args, **kwargs):
        raise AssertionError("the checkpoint was staged in the system's temp directory")

    # Lightning's own writer stages every save there (fsspec's transaction makes its temp file with mkstemp).
    monkeypatch.setattr(tempfile, "mkstemp", staged)
    monkeypatch.setattr(tempfile, "NamedTemporaryFile", staged)
    io = getattr(strategies, strategy)().checkpoint_io
    final = tmp_path / "checkpoints" / "step000005.ckpt"
    write_then_swap(ONE_RANK, final, lambda path: io.save_checkpoint({"weight": torch.arange(4.0)}, path))
    assert torch.equal(torch.load(final)["weight"], torch.arange(4.0)) and leftovers(final.parent) == []


def test_a_rank_whose_part_was_written_fails_with_the_rank_whose_write_failed(tmp_path, monkeypatch):
    # DDP: global rank 0 writes the file and fails; rank 1 writes nothing. Alone, it would go on to the next
    # collective and wait there until the job's timeout.
    from lightning_dist.checkpoints import swap

    said = "saving the checkpoint /runs/x/last.ckpt failed (No space left on device); the disk is full: ..."
    monkeypatch.setattr(swap, "gather_objects", lambda own: [said, own])
    rank_1 = SimpleNamespace(local_rank=1, is_global_zero=False, world_size=1, barrier=lambda *args: None)
    with pytest.raises(swap.SaveFailedElsewhere, match=f"^{re.escape(said)}$"):
        write_then_swap(rank_1, tmp_path / "last.ckpt", lambda path: None)
