"""A rank that Lightning started fails first: the job exits with that rank's code (1 for an error, 128 + N for a
rank killed by signal N), never the 137 of Lightning's own SIGKILL of rank 0, and the ranks still running end."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Rank 0's process: the patched observer of Lightning's launcher watching a rank that fails and one that is stuck.
RANK_ZERO = """
import os, subprocess, sys, time
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning_dist._compat.lightning import end_job_as_its_failed_rank

end_job_as_its_failed_rank()
stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
failing = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(stuck.pid, flush=True)
_ChildProcessObserver(main_pid=os.getpid(), child_processes=[stuck, failing], sleep_period=0.2).start()
time.sleep(60)  # as rank 0 would be, busy or waiting in a collective
sys.exit(99)
"""


@pytest.mark.parametrize("failure, code", [("raise SystemExit(1)", 1), ("raise SystemExit(2)", 2),
                                           ("import os; os.kill(os.getpid(), 9)", 137)])
def test_the_job_exits_with_the_failed_ranks_code_and_ends_the_others(failure, code):
    job = subprocess.run([sys.executable, "-c", RANK_ZERO, failure], capture_output=True, text=True, timeout=60)
    assert job.returncode == code, job.stderr[-2000:]
    stuck = int(job.stdout.split()[0])
    # SIGKILLed by the observer: gone, or a zombie until init reaps it (not running)
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(stuck)], capture_output=True, text=True).stdout.strip()
    assert state in ("", "Z"), state
