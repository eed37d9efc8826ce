"""`plan=true` and `dry_run=true` train nothing and leave nothing in `hydra.run.dir` (Hydra's `.hydra/`, an empty
`train.log`, the run's claim): the run they were made for then goes into that directory, not refused there."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, run_train

SAID = {"plan=true": "Memory plan: ddp", "dry_run=true": "**peak**"}


@pytest.mark.parametrize("option", list(SAID))
def test_a_plan_or_a_dry_run_leaves_nothing_in_its_run_directory(option, tmp_path):
    run_dir = tmp_path / "run"
    looked = subprocess.run([sys.executable, str(REPO / "train.py"), option, f"hydra.run.dir={run_dir}"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=600)
    assert looked.returncode == 0, looked.stderr[-3000:]
    assert SAID[option] in looked.stdout
    assert not run_dir.exists(), sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    if option == "plan=true":  # and so the run it planned goes there
        trained = run_train(run_dir, "trainer.max_steps=2", "test=false")
        assert trained.process.returncode == 0, trained.output[-3000:]
        assert trained.summary["global_step"] == 2
