"""A checkpoint the run cannot read (no permission, an I/O error, a file that vanished) is passed over by
`resume=true` for an older whole one, refused in one line as `ckpt_path`; and a save whose name cannot be freed (an
earlier save this user may not move or remove) is kept under a name of its own: never the end of the job.

Our machines and CI run as root, whom permission bits do not stop: the reads are refused by the process's own
`open`, the only place a test can make the system say no to root; the saves meet a real refusal, the immutable
attribute (`chattr +i`), which stops root too."""

from __future__ import annotations

import builtins
import io
import os
import subprocess
from pathlib import Path

import pytest
import torch

from lightning_dist.checkpoints.autoresume import newest_whole_checkpoint_in
from lightning_dist.checkpoints.swap import write_then_swap
from tests.checkpoints.test_resume_search import COMMAND, default_model_weights, earlier_run, saved
from tests.checkpoints.test_swapped_saves import ONE_RANK
from tests.test_config_errors import build_error


@pytest.fixture
def refused_reads(monkeypatch):
    """`refuse(path, errno, reason)`: opening `path` fails as the system says it (PermissionError for 13)."""
    refused: dict[Path, OSError] = {}
    real_open = builtins.open

    def guarded_open(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and (error := refused.get(Path(file).absolute())):
            raise error
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(io, "open", guarded_open)

    def refuse(path: Path, number: int = 13, reason: str = "Permission denied") -> None:
        refused[path.absolute()] = (PermissionError if number == 13 else OSError)(number, reason, str(path))

    return refuse


def sharded_save(directory: Path, step: int) -> Path:
    """A whole checkpoint directory as FSDP writes it: torch.distributed.checkpoint's shards and `.metadata`, and
    Lightning's meta.pt beside them."""
    from torch.distributed.checkpoint import save

    save({"state_dict": {"weight": torch.zeros(64)}}, checkpoint_id=directory)
    torch.save({"global_step": step}, directory / "meta.pt")
    os.utime(directory, (1_000_000 + step, 1_000_000 + step))
    return directory


def test_a_checkpoint_that_cannot_be_opened_is_passed_over_for_an_older_whole_one(tmp_path, refused_reads):
    run = earlier_run(tmp_path, "earlier", COMMAND)
    whole = saved(run / "checkpoints" / "step000005.ckpt", 5)
    sharded = sharded_save(run / "checkpoints" / "step000010", 10)
    shard = next(sharded.glob("*.distcp"))
    last = saved(run / "checkpoints" / "last.ckpt", 15)
    refused_reads(last)
    refused_reads(shard)

    passed = []
    assert newest_whole_checkpoint_in(run, lambda path, why: passed.append((path.name, why))) == whole
    assert passed == [("last.ckpt", f"it cannot be read (Permission denied: {last})"),
                      ("step000010", f"it cannot be read (Permission denied: {shard})")]


@pytest.mark.parametrize("error", [OSError(5, "Input/output error"), FileNotFoundError(2, "No such file or directory")],
                         ids=["io-error", "vanished"])
def test_an_os_error_anywhere_in_the_checks_passes_the_checkpoint_over(tmp_path, error, monkeypatch):
    run = earlier_run(tmp_path, "earlier", COMMAND)
    whole = saved(run / "checkpoints" / "step000005.ckpt", 5)
    last = saved(run / "checkpoints" / "last.ckpt", 10)
    error.filename = str(last / "inside")

    def vet(path: Path) -> str | None:  # as reading the checkpoint's weights meets the error
        if path == last:
            raise error
        return None

    passed = []
    assert newest_whole_checkpoint_in(run, lambda path, why: passed.append((path.name, why)), vet) == whole
    assert passed == [("last.ckpt", f"it cannot be read ({error.strerror}: {last / 'inside'})")]


def test_a_ckpt_path_that_cannot_be_opened_is_refused_in_one_line(tmp_path, refused_reads):
    checkpoint = saved(tmp_path / "last.ckpt", 5, default_model_weights())
    refused_reads(checkpoint)
    assert build_error([f"ckpt_path={checkpoint}"]) == (
        f"ckpt_path: {checkpoint}: it cannot be read (Permission denied: {checkpoint}); pass a checkpoint this run"
        " can read")


def test_a_ckpt_path_whose_read_fails_midway_is_refused_in_one_line(tmp_path, monkeypatch):
    checkpoint = saved(tmp_path / "last.ckpt", 5, default_model_weights())

    def failing_load(file, *args, **kwargs):  # as torch.load meets a disk's I/O error
        raise OSError(5, "Input/output error", str(file))

    monkeypatch.setattr(torch, "load", failing_load)
    assert build_error([f"ckpt_path={checkpoint}"]) == (
        f"ckpt_path: {checkpoint}: it cannot be read (Input/output error: {checkpoint})")


@pytest.fixture
def immutable(tmp_path):
    """`make_immutable(path)`: `chattr +i` (root cannot rename or remove it either; our machines and CI run as root
    on ext4), undone when the test ends."""
    made: list[Path] = []

    def make_immutable(path: Path) -> None:
        done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
        assert done.returncode == 0, f"the test sets the immutable attribute: {done.stderr.strip()}"
        made.append(path)

    yield make_immutable
    for path in made:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def shards(step: str):
    def write(path: Path) -> None:
        path.mkdir()
        (path / "shard_0").write_text(step)

    return write


def test_a_save_whose_name_cannot_be_freed_is_kept_beside_it_and_the_job_goes_on(tmp_path, immutable):
    final = tmp_path / "last.ckpt"
    shards("step 5")(final)
    immutable(final)  # it can be neither moved aside nor removed

    with pytest.warns(UserWarning, match=rf"^the checkpoint {final} cannot be replaced \(Operation not permitted: "):
        write_then_swap(ONE_RANK, final, shards("step 10"))
    write_then_swap(ONE_RANK, final, shards("step 15"))  # the next save takes the place of the one kept beside
    assert (final / "shard_0").read_text() == "step 5"
    assert (tmp_path / "last.ckpt.new" / "shard_0").read_text() == "step 15"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "last.ckpt.new"]


def test_a_file_save_whose_name_cannot_be_freed_is_kept_beside_it(tmp_path, immutable):
    final = tmp_path / "last.ckpt"
    final.write_text("step 5")
    immutable(final)
    with pytest.warns(UserWarning, match="cannot be replaced"):
        write_then_swap(ONE_RANK, final, lambda path: path.write_text("step 10"))
    assert final.read_text() == "step 5" and (tmp_path / "last.ckpt.new").read_text() == "step 10"


def test_an_earlier_save_set_aside_that_cannot_be_removed_stays_and_the_save_takes_its_name(tmp_path, immutable):
    final, stale = tmp_path / "last.ckpt", tmp_path / ".last.ckpt.previous"
    shards("step 5")(final)
    shards("step 1")(stale)
    immutable(stale)
    with pytest.warns(UserWarning, match=rf"^{stale}, an earlier save set aside, cannot be removed \(Operation not"):
        write_then_swap(ONE_RANK, final, shards("step 10"))
    assert (final / "shard_0").read_text() == "step 10"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".last.ckpt.previous", "last.ckpt"]
