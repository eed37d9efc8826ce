"""A signal at any moment of a run's start ends every process of it within seconds, with the documented exit code
(a scaled-down `python -m scripts.early_signal_loop`, which runs 5 of each delay and strategy), and a rank dies with
the process that started it, however that one died."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from lightning_dist.lifecycle.stop_signals import LAUNCHER_ENV, process_alive
from scripts.early_signal_loop import GONE_WITHIN_S, one_run
from tests.conftest import REPO
from tests.warm_python import REAL_PYTHON

# What it kept: said in general before the run knows where it saves; then its checkpoints (none yet in these runs).
STOPPED = (r"error: stopped by {name}, and the ranks it started with it; (checkpoints saved before it are kept"
           r" \(resume=true continues from the newest\)|nothing was saved before it \(\S+/checkpoints holds no whole"
           r" checkpoint\): resume=true starts afresh)")


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "delay_s", "signum", "code"), [
    ("ddp", 5.0, signal.SIGTERM, 75),  # the ranks starting, joining the process group
    ("deepspeed_stage_2", 3.0, signal.SIGTERM, 75),
    ("ddp", 4.0, signal.SIGINT, 130),  # Ctrl-C
])
def test_a_signal_before_training_ends_every_process_with_the_documented_code(strategy, delay_s, signum, code, deepspeed_ops):
    run = one_run(strategy, delay_s, signum)
    assert run.left == [], f"left running {GONE_WITHIN_S} s after {signum.name}: {run.left}\n{run.stderr[-3000:]}"
    assert run.code in (code, 0), run.stderr[-3000:]  # 0: it finished first
    assert "Traceback" not in run.stderr
    if run.code:
        assert re.fullmatch(STOPPED.format(name=signum.name), run.stderr.splitlines()[-1]), run.stderr[-3000:]


@pytest.mark.parametrize(("at", "devices"), [("init", 2), ("fit_start", 1)])
def test_an_error_after_a_stop_signal_leaves_as_the_stop(at, devices, tmp_path):
    # The stop signal is swallowed where it lands and that code then fails: the run ends as the stop, in its line,
    # with neither the error's line (exit_with) nor Hydra's traceback of a failed job.
    process = subprocess.run(
        [sys.executable, str(REPO / "train.py"), f"trainer.devices={devices}", "trainer.max_steps=2", "test=false",
         "+callbacks.swallow._target_=tests.probes.StopSwallowedThenFails", f"+callbacks.swallow.at={at}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert process.returncode == 75, process.stderr[-3000:]
    assert "Traceback" not in process.stderr and "RecursionError" not in process.stderr, process.stderr[-3000:]
    errors = [line for line in process.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.fullmatch(STOPPED.format(name="SIGTERM"), errors[0]), process.stderr[-3000:]
    assert process.stderr.strip().splitlines()[-1] == errors[0]


RANK = """
import sys, time
from lightning_dist.lifecycle.stop_signals import end_with_launcher
if sys.argv[1] == "asks":
    end_with_launcher()
print("ready", flush=True)
time.sleep(120)
"""
LAUNCHER = """
import os, subprocess, sys, time
env = {**os.environ, "LAUNCHER_ENV": str(os.getpid())}
ranks = [subprocess.Popen([sys.executable, "-c", sys.argv[1], asks], env=env, stdout=subprocess.PIPE, text=True)
         for asks in ("asks", "does not ask")]
assert all(rank.stdout.readline() == "ready\\n" for rank in ranks)
print(*(rank.pid for rank in ranks), flush=True)
time.sleep(120)
""".replace("LAUNCHER_ENV", LAUNCHER_ENV)


def test_a_rank_dies_with_the_process_that_started_it_even_by_sigkill():
    # Real interpreters: the rank's parent must be the process that started it (not the suite's warm process).
    launcher = subprocess.Popen([REAL_PYTHON, "-c", LAUNCHER, RANK], cwd=REPO, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
    asks, does_not_ask = map(int, launcher.stdout.readline().split())
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10
    while process_alive(asks) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert not process_alive(asks)
        assert process_alive(does_not_ask)  # what every rank did before: it outlived its launcher
    finally:
        for pid in (asks, does_not_ask):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
