"""A module fitted, then fitted again, then tested, and a new module tested from its checkpoint
(tests/two_trainers_script.py): under ld_fsdp a second `L.Trainer` trains on from the first as under Lightning's
ddp. Pipeline stages split the module in place (each rank keeps its stages' blocks): the same Trainer tests it and
fits it again with ddp's losses, and a second Trainer stops on every rank in one line naming what to do. Before,
both stopped with "the model's 1 blocks do not divide into 2 stages", counting the blocks rank 1 had kept, and
testing a new module from a checkpoint after a fit stopped under ld_fsdp (`KeyError: 0`: DCP loaded the fit's
optimizer state for it) and under pipeline stages (the fit's stages were run for it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, TRAIN_ENV

pytestmark = pytest.mark.slow  # real runs on 2 CPU ranks

SCRIPT = REPO / "tests" / "two_trainers_script.py"


def _run(out: Path, strategy: str, devices: int = 2, mode: str = "new") -> subprocess.CompletedProcess:
    out.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, str(SCRIPT), str(out), strategy, str(devices), mode], cwd=REPO,
                          env={**TRAIN_ENV, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600)


def test_a_second_trainer_trains_on_from_the_first_and_tests_as_under_ddp(tmp_path):
    losses = {}
    for strategy in ("ddp", "ld_fsdp"):  # Lightning's own ddp first: the reference
        process = _run(tmp_path / strategy, strategy)
        assert process.returncode == 0, process.stderr[-3000:]
        losses[strategy] = json.loads((tmp_path / strategy / "rank0.json").read_text())
    assert len(losses["ddp"]["losses"]) == 4
    assert losses["ld_fsdp"]["losses"] == pytest.approx(losses["ddp"]["losses"], rel=1e-5)
    trained, from_checkpoint = losses["ddp"]["tested"]
    assert from_checkpoint == pytest.approx(trained, rel=1e-6)
    assert losses["ld_fsdp"]["tested"] == pytest.approx(losses["ddp"]["tested"], rel=1e-5)


def test_the_trainer_that_split_a_module_into_stages_fits_it_again_and_tests_as_ddp(tmp_path):
    for name, strategy, devices in (("ddp", "ddp", 1), ("pp", "ld_fsdp_pp", 2)):  # 2 stages: one replica, as ddp's 1
        process = _run(tmp_path / name, strategy, devices, mode="same")
        assert process.returncode == 0, process.stderr[-3000:]
    reference = json.loads((tmp_path / "ddp" / "rank0.json").read_text())
    assert len(reference["losses"]) == 4
    # The last stage computes the loss, once per microbatch (2 a step, each one row of the batch of 2).
    first, last = (json.loads((tmp_path / "pp" / f"rank{rank}.json").read_text()) for rank in (0, 1))
    assert first["losses"] == []
    microbatches = last["losses"]
    steps = [(first + second) / 2 for first, second in zip(microbatches[::2], microbatches[1::2])]
    assert steps == pytest.approx(reference["losses"], rel=1e-5)
    assert first["tested"] == last["tested"] == pytest.approx(reference["tested"], rel=1e-5)


def test_a_second_trainer_of_a_module_split_into_stages_stops_in_one_line(tmp_path):
    process = _run(tmp_path, "ld_fsdp_pp")
    assert process.returncode == 1
    line = ("ValueError: strategy.pipeline_parallel_size=2: this module was split into pipeline stages by an earlier"
            " Trainer in this process, each rank keeping its stages' blocks alone; go on with that Trainer"
            " (trainer.test, trainer.predict, trainer.fit), or build the module anew (from a checkpoint) for a new"
            " one")
    assert process.stderr.count(line) == 2  # each rank's
    assert "do not divide" not in process.stderr
