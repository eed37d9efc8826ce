"""The package passes its linter (ruff, as pyproject.toml configures it): a finding fails the suite, and so CI."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def run_ruff(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *arguments], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_ruff_finds_nothing_in_the_package():
    done = run_ruff("lightning_dist")
    assert (done.returncode, done.stderr) == (0, ""), done.stdout


def test_ruff_fails_on_a_finding(tmp_path):
    (tmp_path / "bad.py").write_text("import os\nx = 1\n")
    done = run_ruff("--config", str(REPO / "pyproject.toml"), str(tmp_path / "bad.py"))
    assert done.returncode == 1 and "F401" in done.stdout
