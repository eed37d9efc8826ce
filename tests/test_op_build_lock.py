"""A native op's build lock left by a process that ended is removed before the op loads (which would otherwise wait
for it forever); a lock a live process holds, one just released, and one on a network filesystem are left."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from lightning_dist.lifecycle import op_build_lock
from lightning_dist.lifecycle.op_build_lock import clear_abandoned
from tests import warm_python
from tests.conftest import REPO

pytestmark = pytest.mark.compat  # also run on the oldest and the newest torch (.ci/compat_tier)


def abandoned_lock(directory):
    lock = directory / "lock"
    lock.touch()
    an_hour_ago = time.time() - 3600
    os.utime(lock, (an_hour_ago, an_hour_ago))
    return lock


def test_a_lock_no_process_holds_is_removed_and_said(tmp_path):
    lock, said = abandoned_lock(tmp_path), []
    assert clear_abandoned(lock, said.append)
    assert not lock.exists()
    assert said == [f"removed {lock}, left behind by a process that ended while it compiled or loaded the op: every"
                    " run loading the op would have waited on it, with no end"]
    assert not clear_abandoned(lock, said.append) and len(said) == 1  # gone: nothing to do, nothing said


def test_a_lock_a_live_process_holds_open_is_left_until_that_process_ends(tmp_path):
    lock, said = abandoned_lock(tmp_path), []
    # The real interpreter: a warm one's child outlives its launcher's kill for a moment.
    holder = subprocess.Popen([warm_python.REAL_PYTHON, "-c", "import sys, time; held = open(sys.argv[1]); print(flush=True);"
                               " time.sleep(120)", str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        holder.stdout.readline()  # the file is open
        assert not clear_abandoned(lock, said.append)  # a build in progress, however old its lock
        assert lock.exists() and said == []
    finally:
        holder.kill()
        holder.wait()
    assert clear_abandoned(lock, said.append) and not lock.exists()


def test_a_lock_just_made_may_be_a_release_in_progress_and_is_left(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    assert not clear_abandoned(lock, print)
    assert lock.exists()


def test_on_a_network_filesystem_the_lock_is_named_not_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(op_build_lock, "_filesystem_type", lambda path: "nfs4")
    lock, said = abandoned_lock(tmp_path), []
    assert not clear_abandoned(lock, said.append)
    assert lock.exists()
    assert said == [f"{lock} is held by no process on this machine: unless one on another machine is compiling into"
                    f" {tmp_path}, remove it (loading this op waits until it is gone)"]


def test_the_filesystem_type_is_read_from_the_mounts():
    assert op_build_lock._filesystem_type(REPO) == next(
        line.split()[2] for line in open("/proc/self/mounts") if line.split()[1] == _mount_point(REPO))


def _mount_point(path) -> str:
    path = os.path.realpath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


@pytest.mark.slow
def test_an_op_whose_lock_was_abandoned_loads_instead_of_waiting_forever(tmp_path, deepspeed_ops):
    """The op as this suite built it, copied with a lock a killed process left: `prepare` loads it in seconds."""
    from lightning_dist._compat.deepspeed import op_build_directory
    from lightning_dist._compat.torch import extension_build_lock

    extensions = tmp_path / "extensions"
    shutil.copytree(op_build_directory("cpu_adam"), extensions / "cpu_adam", ignore=shutil.ignore_patterns("lock"))
    lock = abandoned_lock(extensions / "cpu_adam")
    process = subprocess.run([sys.executable, "-m", "lightning_dist.prepare", "cpu_adam"], cwd=REPO,
                             env={**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions)}, capture_output=True,
                             text=True, timeout=300)  # without the removal: waits here until the timeout
    assert process.returncode == 0, process.stderr[-3000:]
    assert "cpu_adam: ready in" in process.stdout
    if extension_build_lock(lock.parent) is None:
        # torch 2.14 on: an advisory lock on the file, which ended with its holder. The file stays and blocks
        # nothing: it is neither removed nor said to be left behind (at every load).
        assert "left behind" not in process.stdout and lock.exists()
    else:
        assert f"removed {lock}, left behind by a process that ended" in process.stdout and not lock.exists()
