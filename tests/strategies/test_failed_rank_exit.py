"""A rank that Lightning started fails first: the job exits with that rank's code (1 for an error, 128 + N for a
rank killed by signal N), never the 137 of Lightning's own SIGKILL of rank 0, and the ranks still running end. A
rank that died of the stop signal its launcher passed on ends the job as that stop."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Rank 0's process: Lightning's observer, patched as our launcher patches it, watching a rank that fails and one that
# is stuck. `STOPPED`: this process was told SIGTERM and passed it on (the main thread may not have seen it yet).
RANK_ZERO = """
import os, signal, subprocess, sys, time
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning_dist.lifecycle import stop_signals
from lightning_dist._compat.lightning import end_job_as_its_failed_rank
from lightning_dist.strategies.launcher import end_as_failed_rank

end_job_as_its_failed_rank(end_as_failed_rank)
if os.environ.get("STOPPED"):
    stop_signals._signalled = signal.SIGTERM
stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
failing = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(stuck.pid, flush=True)
_ChildProcessObserver(main_pid=os.getpid(), child_processes=[stuck, failing], sleep_period=0.2).start()
time.sleep(60)  # as rank 0 would be, busy or waiting in a collective
sys.exit(99)
"""
KILLED_BY_SIGTERM = "import os; os.kill(os.getpid(), 15)"


@pytest.mark.parametrize("failure, stopped, code", [
    ("raise SystemExit(1)", False, 1), (KILLED_BY_SIGTERM, False, 143), (KILLED_BY_SIGTERM, True, 75),
])
def test_the_job_exits_with_the_failed_ranks_code_and_ends_the_others(failure, stopped, code):
    env = {"STOPPED": "1"} if stopped else {}
    job = subprocess.run([sys.executable, "-c", RANK_ZERO, failure], capture_output=True, text=True, timeout=60,
                         env={**os.environ, **env})
    assert job.returncode == code, job.stderr[-2000:]
    if stopped:
        assert job.stderr.strip().splitlines()[-1].startswith("error: stopped by SIGTERM, and the ranks it started with it")
    stuck = int(job.stdout.split()[0])
    # SIGKILLed by the observer: gone, or a zombie until init reaps it (not running)
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(stuck)], capture_output=True, text=True).stdout.strip()
    assert state in ("", "Z"), state
