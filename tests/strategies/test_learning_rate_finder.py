"""`Tuner(trainer).lr_find(model)` then `trainer.fit(model)`, a user's script as Lightning's docs write it
(tests/lr_find_script.py), finds under ld_ddp and ld_fsdp the learning rate Lightning's ddp finds, and the fit after
it trains from the restored weights to the same losses. Before: rank 0 ended the other ranks as stuck when the
search's fit ended (Lightning ends it with an exception on every rank), so the user's `trainer.fit` failed
("Connection closed by peer"), and under ld_fsdp the restore stopped first (`Missing key in checkpoint state_dict:
optimizer_0.param_groups.0.initial_lr`, a key the search's scheduler added). Where an engine cannot search, the
launch stops in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, TRAIN_ENV

pytestmark = pytest.mark.slow  # real runs on 2 CPU ranks

SCRIPT = REPO / "tests" / "lr_find_script.py"


def _run(out: Path, strategy: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(out), strategy], cwd=REPO,
                          env={**TRAIN_ENV, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> dict[str, dict]:
    results = {}
    for strategy in ("ddp", "ld_ddp", "ld_fsdp"):  # Lightning's own ddp first: the reference
        out = tmp_path_factory.mktemp(strategy)
        process = _run(out, strategy)
        assert process.returncode == 0, process.stderr[-3000:]
        results[strategy] = json.loads((out / "result.json").read_text())
    return results


def test_lightning_s_ddp_finds_a_learning_rate_and_trains_with_it(found):
    reference = found["ddp"]
    assert reference["suggestion"] is not None and reference["suggestion"] != 1e-3
    assert reference["lr"] == reference["suggestion"]  # the Tuner set it on the module
    assert len(reference["losses"]) == 3
    assert reference["left"] == []  # its checkpoint removed


@pytest.mark.parametrize("strategy", ["ld_ddp", "ld_fsdp"])
def test_our_strategies_find_the_same_rate_and_train_on_from_the_restored_model(found, strategy):
    reference, ours = found["ddp"], found[strategy]
    assert ours["suggestion"] == pytest.approx(reference["suggestion"], rel=1e-9)
    assert ours["lr"] == ours["suggestion"]
    # The same losses: the search's steps were undone (weights and optimizer state restored) on every rank.
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-4)
    assert ours["left"] == []


@pytest.mark.parametrize(("strategy", "why"), [
    ("ld_deepspeed_stage_2", "searches by scheduling a torch optimizer, which DeepSpeed's engine replaces with its own"),
    ("ld_fsdp_pp", "fits the model twice, and pipeline stages split it in place in the first fit"),
])
def test_an_engine_that_cannot_search_stops_before_any_rank_starts(tmp_path, strategy, why):
    process = _run(tmp_path, strategy)
    assert process.returncode == 1
    assert f"Tuner.lr_find (LearningRateFinder) {why}: find the learning rate under ld_ddp or ld_fsdp" in process.stderr
    assert "Initializing distributed" not in process.stdout + process.stderr  # no rank started
