"""A native op's build lock left behind by a process that ended.

torch's JIT builder creates `<build directory>/lock` (exclusively, and keeps it open) for as long as one process
compiles an op or checks that it is compiled, a second or minutes; every other process that loads the op waits for
the file to go, with no end and no output. A process killed in that time (a preempted job, a rank ended because
another failed) leaves the file behind, and every later run that loads the op waits on it forever. Before an op
loads, a lock that no process holds open and that is older than a release takes is removed, and the run says so.
On a network filesystem (a home directory other machines compile into, whose processes cannot be seen from here)
the lock is only named."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

# Filesystems other machines may write to: a lock there may be held by a process this machine cannot see.
NETWORK_FILESYSTEMS = {"nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "ceph", "beegfs", "glusterfs",
                       "9p", "afs", "wekafs"}
# A release closes the file, then removes it: a lock younger than this may be in that instant, not abandoned.
SETTLED_S = 5.0


def clear_abandoned(lock: Path, say: Callable[[str], None]) -> bool:
    """Remove `lock` if the process that made it has ended (saying so); True if removed."""
    try:
        status = lock.stat()
    except FileNotFoundError:
        return False
    if time.time() - status.st_mtime < SETTLED_S or not _holders_visible(status.st_uid) or _held_open(lock):
        return False
    filesystem = _filesystem_type(lock)
    if filesystem in NETWORK_FILESYSTEMS or filesystem.startswith("fuse"):
        say(f"{lock} is held by no process on this machine: unless one on another machine is compiling into"
            f" {lock.parent}, remove it (loading this op waits until it is gone)")
        return False
    lock.unlink(missing_ok=True)
    say(f"removed {lock}, left behind by a process that ended while it compiled or loaded the op: every run loading"
        " the op would have waited on it, with no end")
    return True


def _holders_visible(owner: int) -> bool:
    """Whether /proc shows every process that could hold a file of `owner`'s: root sees all, others their own."""
    return Path("/proc/self/fd").is_dir() and (os.geteuid() == 0 or os.geteuid() == owner)


def _held_open(path: Path) -> bool:
    return lock_holder(path) is not None


def lock_holder(path: Path) -> int | None:
    """The pid of a process on this machine that has `path` open (the one compiling or checking the op), if any."""
    target = os.path.realpath(path)
    for descriptors in Path("/proc").glob("[0-9]*/fd"):
        try:
            links = [os.readlink(entry) for entry in descriptors.iterdir()]
        except OSError:  # a process that ended as we looked, or one we may not read
            continue
        if target in links:
            return int(descriptors.parent.name)
    return None


def _filesystem_type(path: Path) -> str:
    """The type of the filesystem `path` is on, from the longest mount point above it (empty where unknown)."""
    target, best, kind = os.path.realpath(path), "", ""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return ""
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best):
            best, kind = point, fields[2]
    return kind
