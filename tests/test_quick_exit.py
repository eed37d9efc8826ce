"""A run leaves without the interpreter's teardown, and loses nothing by it: threads finish, `atexit` handlers run,
a file the code left open and unflushed is written, and the exit status is the one `sys.exit` would give. An idle
thread pool (torch.compile leaves one) is told to finish, as at a normal exit, rather than waited on forever."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from lightning_dist.lifecycle.quick_exit import exit_quickly

idle_pool = ThreadPoolExecutor(max_workers=2)
idle_pool.submit(lambda: None).result()  # its worker now waits for work, in a non-daemon thread

left_open = open(sys.argv[1], "w")
left_open.write("written before the exit, never flushed")
atexit.register(lambda: print("atexit handler ran", flush=True))
threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished", flush=True))).start()
code = sys.argv[2]
exit_quickly(None if code == "None" else int(code) if code.lstrip("-").isdigit() else code)
"""


@pytest.mark.parametrize("code, status", [("None", 0), ("0", 0), ("75", 75), ("no such checkpoint", 1)])
def test_exit_quickly_keeps_what_a_normal_exit_does(code, status, tmp_path):
    left_open = tmp_path / "left_open.txt"
    process = subprocess.run([sys.executable, "-c", SCRIPT, str(left_open), code], capture_output=True, text=True, timeout=60)
    assert process.returncode == status, process.stderr[-2000:]
    assert process.stdout.splitlines() == ["thread finished", "atexit handler ran"]
    assert left_open.read_text() == "written before the exit, never flushed"
    assert process.stderr.strip() == ("no such checkpoint" if status == 1 else "")
