"""In an interactive session (Jupyter), every preset's ranks are forked from the kernel; elsewhere the script is
re-run, as Lightning does."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time

import lightning as L
import pytest
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

import lightning_dist  # noqa: F401  registers the ld_* names
from lightning_dist.strategies import REGISTRY_PREFIX
from lightning_dist.strategies.launcher import ForkedRanks, end_processes
from tests.conftest import REPO, STRATEGY_NAMES

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


AFTER_THE_KERNEL_USED_ITS_THREADS = """
import sys
sys.ps1 = ">>> "  # as in Jupyter
import lightning as L, torch
import lightning_dist
from lightning_dist.data.pydoc_text import PydocTextDataModule
from lightning_dist.models.gpt import GPTLanguageModel
(torch.randn(4_000_000) * 2).long().sum()  # the kernel's OpenMP threads have run
trainer = L.Trainer(strategy="ld_ddp", accelerator="cpu", devices=2, max_steps=2, limit_val_batches=0, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(GPTLanguageModel(n_layer=1, d_model=32, block_size=32), datamodule=PydocTextDataModule(block_size=32))
print("trained", trainer.state.status)
"""


@pytest.mark.slow
def test_forked_ranks_do_not_wait_for_the_kernels_openmp_threads(tmp_path):
    # GNU OpenMP's pool does not survive a fork: with two threads per rank, the ranks' first parallel region hung.
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-c", AFTER_THE_KERNEL_USED_ITS_THREADS], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "trained TrainerStatus.FINISHED" in run.stdout
