"""Which parameters train stays fixed during a fit (strategies/trainable_set.py): each engine sets up at the start
what it reduces and steps. A backbone unfrozen at epoch 1 (tests/unfreeze_script.py) trained each rank's own copy
under Lightning's ddp and ld_ddp (Lightning #20340) and got 0.65 to 0.72 of ddp's gradients under ld_fsdp, without a
word. Now Lightning's `BackboneFinetuning` stops the launch in one line under every strategy of ours, and a module
unfreezing in its own hook stops at the next batch on every rank, in one line; a module that keeps its frozen
backbone frozen trains on (the LoRA runs of the suite)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, TRAIN_ENV

SCRIPT = REPO / "tests" / "unfreeze_script.py"
INSTEAD = ("freeze before the fit and keep it so, or train those weights from the start at a learning rate of 0 in a"
           " param group of their own and raise it when they are to train (Lightning #20340)")


def _run(out: Path, strategy: str, how: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(out), strategy, how], cwd=REPO,
                          env={**TRAIN_ENV, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(("strategy", "name"), [("ld_ddp", "ld_ddp"), ("ld_deepspeed_stage_2", "ld_deepspeed")])
def test_backbone_finetuning_stops_before_any_rank_starts(tmp_path, strategy, name):
    process = _run(tmp_path, strategy, "callback")
    assert process.returncode == 1
    assert (f"BackboneFinetuning (Lightning's BaseFinetuning) unfreezes parameters during the fit, and {name} reduces"
            f" and steps those that were trainable at its setup: {INSTEAD}") in process.stderr
    assert "Initializing distributed" not in process.stdout + process.stderr  # no rank started


def test_a_backbone_unfrozen_in_the_module_s_hook_stops_every_rank_at_the_next_batch(tmp_path):
    process = _run(tmp_path, "ld_fsdp", "hook")
    assert process.returncode == 1
    line = ("RuntimeError: the trainable parameters changed during the fit: 20 became trainable (the first:"
            f" backbone.embed_tokens.weight); ld_fsdp reduces and steps those that were trainable at its setup: {INSTEAD}")
    assert process.stderr.count(line) == 2  # each rank's, at the first batch of epoch 1
    assert not (tmp_path / "losses.json").exists()
