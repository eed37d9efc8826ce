"""`debug=profiler` and `debug=pytorch_profiler`, as typed from a fresh working directory: each rank's report is in
the run directory, under logs/debug/ (apart from real runs), and is the profiler's own."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, TRAIN_ENV, in_the_suite

pytestmark = pytest.mark.slow

REPORTS = {
    # option: (the report each rank writes for fit, what only that profiler's report says)
    "profiler": ("fit-profile-{rank}.txt", "|  run_training_epoch"),
    "pytorch_profiler": ("fit-pytorch_profile-{rank}.txt", "Optimizer.step#AdamW.step"),
}


@pytest.mark.parametrize("option", in_the_suite(sorted(REPORTS), ["pytorch_profiler"]))
def test_each_rank_writes_its_profile_into_the_debug_run(option, tmp_path, deepspeed_ops):
    process = subprocess.run([sys.executable, str(REPO / "train.py"), f"debug={option}"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=600, env=TRAIN_ENV)
    assert process.returncode == 0, process.stderr[-3000:]
    (run_dir,) = (tmp_path / "logs" / "debug" / "runs").iterdir()
    assert not (tmp_path / "logs" / "train").exists()
    name, mark = REPORTS[option]
    for rank in (0, 1):
        report = (run_dir / name.format(rank=rank)).read_text()
        assert report.startswith("FIT Profiler Report") and mark in report, report[:2000]
