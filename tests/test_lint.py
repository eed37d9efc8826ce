"""The package passes its linter and its type checker (ruff and mypy, as pyproject.toml configures them): a finding
fails the suite, and so CI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def run_ruff(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *arguments], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


# Everything that is Python: the package, its tests, the scripts, benchmarks and recipes, and the entry point.
LINTED = ("lightning_dist", "tests", "scripts", "benchmarks", "recipes", "train.py")


def test_ruff_finds_nothing_in_the_package_its_tests_scripts_benchmarks_and_recipes():
    done = run_ruff(*LINTED)
    assert (done.returncode, done.stderr) == (0, ""), done.stdout


def test_ruff_fails_on_a_finding(tmp_path):
    (tmp_path / "bad.py").write_text("import os\nx = 1\n")
    done = run_ruff("--config", str(REPO / "pyproject.toml"), str(tmp_path / "bad.py"))
    assert done.returncode == 1 and "F401" in done.stdout


def run_mypy(*arguments: str, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache), *arguments], cwd=REPO,
                          capture_output=True, text=True, timeout=600)


def test_mypy_finds_nothing_in_the_package(tmp_path):
    done = run_mypy(cache=tmp_path)  # pyproject.toml names the package
    assert done.returncode == 0 and "Success: no issues found" in done.stdout, done.stdout + done.stderr


def test_mypy_fails_on_a_finding(tmp_path):
    (tmp_path / "bad.py").write_text("def f(x: int) -> str:\n    return x\n")
    done = run_mypy(str(tmp_path / "bad.py"), cache=tmp_path / "cache")
    assert done.returncode == 1 and "[return-value]" in done.stdout, done.stdout + done.stderr
