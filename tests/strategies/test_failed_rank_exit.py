"""A rank that Lightning started fails first: the job exits with that rank's code (1 for an error, 128 + N for a
rank killed by signal N), never the 137 of Lightning's own SIGKILL of rank 0, and the ranks still running end. A
rank that died of the stop signal its launcher passed on ends the job as that stop."""

from __future__ import annotations

import os
import re
import socket
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
if os.environ.get("STOP_STUCK"):  # stopped (SIGSTOP): the other ranks time out waiting for it
    os.kill(stuck.pid, signal.SIGSTOP)
failing = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(stuck.pid, failing.pid, flush=True)
_ChildProcessObserver(main_pid=os.getpid(), child_processes=[stuck, failing], sleep_period=0.2).start()
time.sleep(60)  # as rank 0 would be, busy or waiting in a collective
sys.exit(99)
"""
KILLED_BY_SIGTERM = "import os; os.kill(os.getpid(), 15)"


@pytest.mark.parametrize("failure, env, code, said", [
    ("raise SystemExit(1)", {}, 1, "rank 2 (pid {failing} on {host}) exited with code 1"),
    (KILLED_BY_SIGTERM, {}, 143, "rank 2 (pid {failing} on {host}) was killed by SIGTERM"),
    ("raise SystemExit(1)", {"STOP_STUCK": "1"}, 1, "rank 1 (pid {stuck} on {host}) is stopped (SIGSTOP or SIGTSTP)"),
    (KILLED_BY_SIGTERM, {"STOPPED": "1"}, 75, None),
], ids=["exited", "killed", "a rank stopped", "told to stop"])
def test_the_job_exits_with_the_failed_ranks_code_names_it_and_ends_the_others(failure, env, code, said):
    job = subprocess.run([sys.executable, "-c", RANK_ZERO, failure], capture_output=True, text=True, timeout=60,
                         env={**os.environ, **env})
    assert job.returncode == code, job.stderr[-2000:]
    stuck, failing = map(int, job.stdout.split()[:2])
    last = job.stderr.strip().splitlines()[-1]
    if said is None:
        assert last.startswith("error: stopped by SIGTERM, and the ranks it started with it")
    else:  # the job's one error line (Lightning's observer logs its own notice before it)
        said = said.format(failing=failing, stuck=stuck, host=socket.gethostname())
        errors = [line for line in job.stderr.splitlines() if line.startswith("error:")]
        assert errors == [f"error: {said}; the job's other ranks were stopped with it"], job.stderr[-2000:]
    # SIGKILLed by the observer: gone, or a zombie until init reaps it (not running)
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(stuck)], capture_output=True, text=True).stdout.strip()
    assert state in ("", "Z"), state


@pytest.mark.slow
def test_a_rank_killed_mid_run_is_named_first_with_its_signal_not_a_rank_that_lost_it(tmp_path):
    """Three ranks, rank 2 SIGKILLed at step 3: rank 1 loses its connection to it as rank 0 does. Rank 1, a victim,
    said it first ("another rank exited or was killed"), and rank 0 then named rank 1 (8 of 8 runs)."""
    from tests.conftest import run_train

    run = run_train(tmp_path, "trainer.devices=3", "trainer.max_steps=10", "test=false",
                    "+callbacks.kill._target_=tests.probes.SignalAtStep", "+callbacks.kill.global_step=3",
                    "+callbacks.kill.signal=SIGKILL", "+callbacks.kill.rank=2")
    assert run.process.returncode in (1, 137), run.output[-3000:]
    errors = [line[line.index("error: "):] for line in run.output.splitlines() if "error: " in line]
    assert errors and re.fullmatch(r"error: (rank 0 lost its connection to another rank at global step 3: )?rank 2"
                                   rf" \(pid \d+ on {re.escape(socket.gethostname())}\) was killed by SIGKILL.*",
                                   errors[0]), run.output[-3000:]
    assert "Traceback" not in run.output
