"""Lightning's weight averaging as a user adds it (`EMAWeightAveraging`, a `ModelCheckpoint`; tests/
weight_averaging_script.py): ld_ddp trains, saves and tests what Lightning's ddp does; every other engine stops the
launch in one line, before any rank starts (strategies/weight_averaging.py). Before: under ld_fsdp every update
stopped the run, under ZeRO-3 the averaged model tested another loss than ddp's without a word, and under ZeRO-1/2
the checkpoints lost the average (testing one stopped with `KeyError: 'state_dict'`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, TRAIN_ENV

pytestmark = pytest.mark.slow  # real runs on 2 CPU ranks

SCRIPT = REPO / "tests" / "weight_averaging_script.py"


def _run(out: Path, strategy: str, callback: str = "ema") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(out), strategy, callback], cwd=REPO,
                          env={**TRAIN_ENV, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600)


def test_ld_ddp_averages_saves_and_tests_as_lightning_s_ddp(tmp_path):
    tested = {}
    for strategy in ("ddp", "ld_ddp"):  # Lightning's own ddp first: the reference
        process = _run(tmp_path / strategy, strategy)
        assert process.returncode == 0, process.stderr[-3000:]
        tested[strategy] = json.loads((tmp_path / strategy / "result.json").read_text())
    assert set(tested["ddp"]) == {"model", "step 2", "step 4"}
    assert tested["ddp"]["step 2"] != pytest.approx(tested["ddp"]["step 4"])  # each checkpoint its own average
    assert tested["ld_ddp"] == pytest.approx(tested["ddp"], rel=1e-6)


@pytest.mark.parametrize(("strategy", "callback", "why"), [
    ("ld_fsdp", "ema", "ld_fsdp shards the weights, which the copy cannot take (FSDP2's DTensors)"),
    ("ld_fsdp_pp", "swa", "ld_fsdp shards the weights, which the copy cannot take (FSDP2's DTensors)"),
    ("ld_deepspeed_stage_2", "ema", "ld_deepspeed saves the engine's weights in its checkpoints, not that state_dict"
                                    " (the average would be lost)"),
    ("ld_deepspeed_stage_3", "ema", "ld_deepspeed partitions the weights, which the copy cannot take (ZeRO-3's module"
                                    " holds empty placeholders)"),
])
def test_an_engine_whose_ranks_hold_other_weights_stops_before_any_rank_starts(tmp_path, strategy, callback, why):
    process = _run(tmp_path, strategy, callback)
    assert process.returncode == 1
    name = "EMAWeightAveraging" if callback == "ema" else "StochasticWeightAveraging"
    assert (f"{name} keeps a whole copy of the model on every rank and saves it as the checkpoint's state_dict, and"
            f" {why}: average the weights under ld_ddp") in process.stderr
    assert "Initializing distributed" not in process.stdout + process.stderr  # no rank started
    assert not list(tmp_path.glob("*.ckpt"))
