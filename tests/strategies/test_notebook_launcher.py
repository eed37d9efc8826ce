"""In an interactive session (Jupyter), every preset's ranks are forked from the kernel; elsewhere the script is
re-run, as Lightning does."""

from __future__ import annotations

import multiprocessing
import sys
import time

import lightning as L
import pytest
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

import lightning_dist  # noqa: F401  registers the ld_* names
from lightning_dist.strategies import REGISTRY_PREFIX
from lightning_dist.strategies.launcher import ForkedRanks, end_processes
from tests.conftest import STRATEGY_NAMES

NAMES = [REGISTRY_PREFIX + name for name in STRATEGY_NAMES]


def launcher_of(name: str):
    return L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False).strategy.launcher.launcher


@pytest.mark.parametrize("name", NAMES)
def test_a_notebook_forks_the_ranks(name, monkeypatch):
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    launcher = launcher_of(name)
    assert isinstance(launcher, ForkedRanks) and launcher.is_interactive_compatible


@pytest.mark.parametrize("name", NAMES)
def test_a_script_reruns_itself_per_rank(name, monkeypatch):
    monkeypatch.delattr(sys, "ps1", raising=False)
    assert isinstance(launcher_of(name), _SubprocessScriptLauncher)


def _ignore_sigterm_and_sleep():
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(60)


def test_forked_ranks_that_will_not_leave_are_killed_after_the_grace():
    process = multiprocessing.get_context("fork").Process(target=_ignore_sigterm_and_sleep)
    process.start()
    started = time.monotonic()
    end_processes([process], grace_s=0.5)
    assert not process.is_alive() and process.exitcode == -9
    assert time.monotonic() - started < 5
