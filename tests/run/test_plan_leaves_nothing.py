"""`plan=true` and `dry_run=true` train nothing and leave nothing in `hydra.run.dir` (Hydra's `.hydra/`, an empty
`train.log`, the run's claim): the run they were made for then goes into that directory, not refused there."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, run_train

SAID = {"plan=true": "Memory plan: ddp", "dry_run=true": "**peak**"}


def test_what_users_type_leaves_only_the_runs_they_made(tmp_path):
    """From an empty directory, as typed (no `hydra.run.dir`): a plan, a dry run and a refused run leave nothing, not
    even the empty `logs/train/runs/` their run directory was made in; a finished run leaves its directory, without
    its lock."""
    def typed(*overrides: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(REPO / "train.py"), *overrides], cwd=tmp_path, capture_output=True,
                              text=True, timeout=600)

    for option in SAID:
        assert typed(option).returncode == 0
        assert list(tmp_path.iterdir()) == [], option
    refused = typed(f"ckpt_path={tmp_path / 'none.ckpt'}")
    assert refused.returncode == 2 and refused.stderr.strip().startswith("error: ckpt_path: no checkpoint at")
    assert list(tmp_path.iterdir()) == []
    finished = typed("trainer.max_steps=2", "test=false")
    assert finished.returncode == 0, finished.stderr[-3000:]
    (run_dir,) = (tmp_path / "logs" / "train" / "runs").iterdir()
    assert [p.name for p in tmp_path.iterdir()] == ["logs"]
    assert {"metrics.json", "checkpoints", "train.log", ".hydra", "csv"} <= {p.name for p in run_dir.iterdir()}
    assert not (run_dir / ".run.lock").exists()


def test_a_swept_plan_keeps_its_record_and_releases_its_claims(tmp_path):
    """A sweep's job directories are its record (Hydra's `.hydra/`, what each job said), but no job holds its claim
    after it ended: a stale `.run.lock` would say a run is still in there."""
    swept = subprocess.run([sys.executable, str(REPO / "train.py"), "-m", "plan=true", "strategy=ddp,fsdp"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert swept.returncode == 0, swept.stderr[-3000:]
    assert swept.stdout.count("Memory plan: ") == 2
    (sweep,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    assert sorted(str(p.relative_to(sweep)) for p in sweep.rglob(".run.lock")) == []
    assert "Sweep: " not in swept.stdout  # nothing trained: no sweep report to point at


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
