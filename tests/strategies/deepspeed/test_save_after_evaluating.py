"""`trainer.save_checkpoint` after `trainer.test` under ZeRO-3 (Lightning #15247): Lightning tests with a DeepSpeed
engine of its own, which has no checkpoint engine; its save stopped on rank 0 alone and the other ranks waited in
DeepSpeed's barrier for ever. Now every rank stops at once with one line saying to save before evaluating; saved
before, the checkpoint tests to the loss the trained model tested to. tests/save_after_test_script.py is the user's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, TRAIN_ENV

pytestmark = pytest.mark.slow  # real runs on 2 CPU ranks

SCRIPT = REPO / "tests" / "save_after_test_script.py"


def _run(out, mode: str) -> subprocess.CompletedProcess:
    # 150 s: the hang this guards against ended only at that limit (about 20 s a run here).
    return subprocess.run([sys.executable, str(SCRIPT), str(out), "ld_deepspeed_stage_3", mode], cwd=REPO,
                          env={**TRAIN_ENV, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=150)


def test_saving_after_testing_stops_every_rank_in_one_line(tmp_path, deepspeed_ops):
    process = _run(tmp_path, "fit,test,save")
    assert process.returncode == 1
    line = ("CheckpointError: trainer.save_checkpoint after trainer.test, validate or predict under ZeRO-3: Lightning"
            " evaluates with a DeepSpeed engine of its own, which cannot save; save before evaluating")
    assert process.stderr.count(line) == 2  # each rank, at once: none waits for the other
    assert not (tmp_path / "final.ckpt").exists()


def test_saved_before_testing_the_checkpoint_tests_as_the_trained_model(tmp_path, deepspeed_ops):
    process = _run(tmp_path, "fit,save,test")
    assert process.returncode == 0, process.stderr[-3000:]
    in_memory, from_checkpoint = json.loads((tmp_path / "result.json").read_text())
    assert from_checkpoint == pytest.approx(in_memory, rel=1e-6)
    assert 4.0 < in_memory < 5.5  # a 128-token vocabulary's loss near ln(128) = 4.85 after 2 steps
