"""What `resume=true` passes over, and what it says: a link to nothing, a save cut off, a changed file, another
model's weights (tests/checkpoints/test_resume.py, in a real run), each named with its reason; starting afresh says how many it passed over; a checkpoint of another run directory is said to be
that directory's; from the last save of a run that trained to its end, nothing is trained, and the line says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import yaml

from lightning_dist.checkpoints.autoresume import finished_run, newest_complete_checkpoint, newest_whole_checkpoint_in
from tests.conftest import CONF_DIR, REPO

COMMAND = ["trainer.max_steps=2", "test=false"]


def default_model_weights() -> dict:
    """The state dict of the model `python train.py` builds (the bundled GPT), as a Lightning checkpoint holds it."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        model = OmegaConf.to_container(compose("train", overrides=COMMAND).model, resolve=True)
    model.pop("block_class")  # says what the blocks are; not an argument
    return instantiate(model).state_dict()


def saved(path, step: int, state_dict: dict | None = None):
    """A whole `.ckpt` file (torch.save's zip), modified `step` seconds after the epoch's start of this test."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step, "state_dict": state_dict or {"weight": torch.zeros(1024)}}, path)
    os.utime(path, (1_000_000 + step, 1_000_000 + step))
    return path


def earlier_run(root, name: str, overrides: list[str]):
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    return run


def test_links_to_nothing_cut_off_and_changed_saves_are_passed_over_each_with_its_reason(tmp_path):
    run = earlier_run(tmp_path, "earlier", COMMAND)
    whole = saved(run / "checkpoints" / "step000005.ckpt", 5)
    cut_off = saved(run / "checkpoints" / "step000010.ckpt", 10)
    cut_off.write_bytes(cut_off.read_bytes()[:40])
    os.utime(cut_off, (1_000_010, 1_000_010))
    changed = saved(run / "checkpoints" / "step000015.ckpt", 15)
    data = bytearray(changed.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the weight's record: its CRC no longer matches
    changed.write_bytes(bytes(data))
    os.utime(changed, (1_000_015, 1_000_015))
    dangling = run / "checkpoints" / "last.ckpt"
    dangling.symlink_to(run / "checkpoints" / "step000020.ckpt")  # its target was never written
    os.utime(dangling, (1_000_020, 1_000_020), follow_symlinks=False)

    passed = []
    found = newest_complete_checkpoint(tmp_path, COMMAND, lambda path, why: passed.append((path.name, why)))
    assert found == whole
    assert [name for name, _ in passed] == ["last.ckpt", "step000015.ckpt", "step000010.ckpt"]
    assert passed[0][1] == f"a link to {run / 'checkpoints' / 'step000020.ckpt'}, which does not exist"
    assert "does not match its checksum" in passed[1][1], passed[1][1]
    assert passed[2][1] == "its save did not finish"
    assert newest_whole_checkpoint_in(run) == whole  # the same search within one directory (resume=run_dir)


def test_a_checkpoint_the_vet_refuses_is_passed_over_with_its_reason(tmp_path):
    run = earlier_run(tmp_path, "earlier", COMMAND)
    ours, theirs = saved(run / "checkpoints" / "step000010.ckpt", 10), saved(run / "checkpoints" / "last.ckpt", 12)
    passed = []
    found = newest_complete_checkpoint(tmp_path, COMMAND, lambda path, why: passed.append((path, why)),
                                       vet=lambda path: "another model's" if path == theirs else None)
    assert found == ours and passed == [(theirs, "another model's")]


def test_only_the_last_save_of_a_run_that_trained_to_its_end_counts_as_finished(tmp_path):
    run = earlier_run(tmp_path, "earlier", COMMAND)
    early, last = saved(run / "checkpoints" / "step000005.ckpt", 5), saved(run / "checkpoints" / "last.ckpt", 10)
    summary = {"global_step": 10, "last_checkpoint": str(last), "metrics": {}}
    (run / "metrics.json").write_text(json.dumps(summary))
    assert finished_run(last) == run
    assert finished_run(early) is None  # steps 6 to 10 are left to train from it
    (run / "metrics.json").write_text(json.dumps({**summary, "stopped_by": "Preempted"}))
    assert finished_run(last) is None


def resume_in(log_dir) -> subprocess.CompletedProcess:
    """The documented `resume=true` with the default run-directory layout under `log_dir`."""
    command = [sys.executable, str(REPO / "train.py"), f"paths.log_dir={log_dir}", *COMMAND, "resume=true"]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_resume_from_a_finished_run_s_last_save_trains_nothing_says_so_and_leaves_nothing(tmp_path):
    runs = tmp_path / "train" / "runs"
    run = earlier_run(runs, "2026-01-01_00-00-00", [f"paths.log_dir={tmp_path}", *COMMAND])
    last = saved(run / "checkpoints" / "last.ckpt", 2, default_model_weights())  # this model's: resume would take it
    (run / "metrics.json").write_text(json.dumps({"global_step": 2, "last_checkpoint": str(last), "metrics": {}}))

    started = time.monotonic()
    done = resume_in(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert time.monotonic() - started < 60
    output = done.stdout + done.stderr
    assert "Traceback" not in output and "Training " not in output and "Final metrics" not in output, output[-3000:]
    assert (f"resume=true: nothing left to train: the newest whole checkpoint of this command, {last}, is the last save"
            f" of a run that trained to its end ({run / 'metrics.json'}); pass ckpt_path={last} with a larger"
            " trainer.max_steps to train on from it, or resume=false to start afresh") in output
    assert sorted(p.name for p in runs.iterdir()) == [run.name]  # no run directory left for a run that did nothing


@pytest.mark.slow
def test_starting_afresh_says_what_it_passed_over(tmp_path):
    runs = tmp_path / "train" / "runs"
    run = earlier_run(runs, "2026-01-01_00-00-00", [f"paths.log_dir={tmp_path}", *COMMAND])
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "last.ckpt").symlink_to(run / "checkpoints" / "gone.ckpt")

    process = resume_in(tmp_path)
    assert process.returncode == 0, process.stderr[-3000:]
    output = process.stdout + process.stderr
    assert (f"resume=true: passed over {run / 'checkpoints' / 'last.ckpt'}: a link to {run / 'checkpoints' / 'gone.ckpt'},"
            " which does not exist") in output
    assert ("resume=true: no earlier complete checkpoint of this command (passed over 1, named above); starting afresh"
            in output)


def test_the_stop_line_names_the_newest_whole_checkpoint_and_its_step_or_that_nothing_was_saved(tmp_path):
    from lightning_dist.run.resume import what_a_stop_keeps

    checkpoints = tmp_path / "checkpoints"
    assert what_a_stop_keeps(checkpoints) == (
        f"nothing was saved before it ({checkpoints} holds no whole checkpoint): resume=true starts afresh")
    saved(checkpoints / "step000010.ckpt", 10)
    last = saved(checkpoints / "last.ckpt", 20)
    partial = saved(checkpoints / ".last.ckpt.partial", 25)  # a save the stop cut off
    os.utime(partial, (1_000_030, 1_000_030))
    assert what_a_stop_keeps(checkpoints) == f"kept: {last} at step 20 (resume=true continues from it)"
