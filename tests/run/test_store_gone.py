"""A torchrun worker whose node-0 agent is gone while the process group forms: the store it would read a refusal
from went with that agent, and the rendezvous would wait on it for strategy.timeout (30 minutes by default). It ends
once the store has been unreachable for `STORE_GONE_S`, in one line (two real nodes: tests/run/test_two_nodes.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from lightning_dist.lifecycle.collective_timeout import STORE_GONE_S
from tests.conftest import REPO, free_port

# The rendezvous itself, blocked in native code: a sleep stands for it.
WORKER = """
import time
from datetime import timedelta
from lightning_dist.lifecycle.collective_timeout import forming_process_group
with forming_process_group(timedelta(seconds=1800), lambda: 1):
    time.sleep(600)
"""


def test_a_worker_whose_node_0_is_gone_ends_in_one_line_not_after_the_timeout():
    port = free_port()  # nothing listens there: node 0's agent, and its store, are gone
    env = {**os.environ, "TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "RANK": "1", "WORLD_SIZE": "2", "GROUP_RANK": "1"}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", WORKER], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    ended = time.monotonic() - started
    assert done.returncode == 1, done.stderr[-3000:]
    assert STORE_GONE_S <= ended < STORE_GONE_S + 60
    assert done.stderr.splitlines()[-1] == (
        f"error: rank 1: the job's store (torchrun's agent on node 0, at 127.0.0.1:{port}) is gone, and with it node 0,"
        " before the process group formed (set-up); its own output says why")
