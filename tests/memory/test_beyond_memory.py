"""`benchmarks/beyond_memory.py` at a small size: its whole path (the plan, auto_fit, then ZeRO-Infinity with
parameters and optimizer state on the drive) in about a minute. The 2B-parameter run is in BENCHMARKS.md."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.conftest import REPO, TRAIN_ENV, needs_libaio

# Extended (scripts/extended_checks.sh): its one run took 9 minutes of both cores alone and 20 in a loaded suite on
# our 2-core machines; ZeRO-Infinity's training itself is in the suite (tests/strategies/test_nvme_offload.py).
pytestmark = [pytest.mark.slow, pytest.mark.extended, needs_libaio]

D_MODEL = 512  # the smallest width whose large partitions DeepSpeed swaps (>= 1 MiB each over 2 ranks)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, nvme_ops):
    root = tmp_path_factory.mktemp("beyond-memory")
    command = [sys.executable, str(REPO / "benchmarks" / "beyond_memory.py"), "--nvme", str(root / "nvme"),
               "--d-model", str(D_MODEL), "--n-layer", "2", "--steps", "3", "--lr", "1e-3", "--out", str(root / "out")]
    process = subprocess.run(command, cwd=REPO, env={**TRAIN_ENV, "PYTHONPATH": str(REPO)}, capture_output=True,
                             text=True, timeout=900)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    return root, process.stdout


def test_prints_the_plan_then_one_row_per_step_with_falling_loss(small_run):
    root, printed = small_run
    assert "Memory plan: deepspeed_stage_3_offload_nvme, 32-true, 2 ranks" in printed
    assert "auto_fit: chose ddp" in printed  # this small model fits without offload
    rows = [json.loads(line) for line in (root / "out" / "steps.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    losses = [row["loss"] for row in rows]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0], losses
    assert all(0 < peak < 8 * 2**30 for row in rows for peak in row["peak_rss_per_rank"])
    assert printed.rstrip().endswith("finite: True; falling: True")


def test_parameters_live_on_the_drive_through_a_pool_sized_from_the_model(small_run):
    root, _ = small_run
    zero = json.loads((root / "out" / "run" / "deepspeed_config.effective.json").read_text())["zero_optimization"]
    pool = zero["offload_param"]
    assert pool["max_in_cpu"] == 0
    assert pool["buffer_size"] == 4 * D_MODEL * D_MODEL // 2  # half the largest matrix: an MLP weight
    assert zero["stage3_max_reuse_distance"] == 4 * D_MODEL * D_MODEL
    for rank in (0, 1):
        swapped = sorted((root / "nvme" / "zero_stage_3" / "float32params" / f"rank{rank}").iterdir())
        # Per block, both MLP matrices: their halves are at least 1 MiB (q, k and v, 512 KiB halves, stay in memory).
        assert len(swapped) == 2 * 2, [path.name for path in swapped]
        assert all(path.stat().st_size >= 2**20 for path in swapped)
