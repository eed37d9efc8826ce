"""Buffers each rank keeps for itself (BatchNorm's running statistics without SyncBatchNorm) are saved as rank 0 held
them, as DDP (which broadcasts rank 0's) and DeepSpeed (rank 0 writes the module's state) save them. A sharded FSDP
save took each replicated buffer from whichever rank had written least so far: a checkpoint mixing the ranks'
statistics, which no rank ever held, and a test on it that matched no rank's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, TRAIN_ENV

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("strategy", ["ld_fsdp", "ld_deepspeed_stage_2"])
def test_every_rank_tests_with_the_buffers_rank_0_saved(tmp_path, strategy, deepspeed_ops):
    process = subprocess.run([sys.executable, str(REPO / "tests" / "buffers_script.py"), str(tmp_path), strategy],
                             cwd=tmp_path, env={**TRAIN_ENV, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                             timeout=600)
    assert process.returncode == 0, process.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert ranks[0]["saved"] != ranks[1]["saved"]  # each rank's statistics are its own batches'
    for rank in ranks:
        assert rank["tested"] == ranks[0]["saved"]  # bit for bit
