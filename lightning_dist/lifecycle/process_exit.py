"""A rank's process group closed, and its backend's threads finished, while the interpreter can still serve them.

A collective issued inside a backward pass keeps a copy of the thread's Python state (torch stashes the autograd
context there), and the gloo worker thread that ran it drops that copy after the caller has already moved on. Dropping
it takes the GIL. If the interpreter has begun to finalize by then, Python ends the worker with `pthread_exit` inside
a destructor that may not unwind, and C++ aborts the whole process: "terminate called without an active exception",
exit code -6 after a run that trained to the end. We caught it in a core dump of a user's own script on
ld_fsdp_cpu_offload (the worker in `ProcessGroupGloo::runLoop` -> `~AsyncAllreduceWork` -> `~ThreadLocalState` ->
GIL), and on ld_deepspeed_stage_3(_offload) in CI. Lightning destroys only nccl groups at exit; torch's own fix
(pytorch/pytorch#179291) was withdrawn. Checked on torch 2.13.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

# How long exit may wait for the backend's threads: a worker starved of a core for a while still gets there.
THREADS_SETTLE_DEADLINE_S = 1.0
_POLL_S = 0.005
_QUIET_POLLS_NEEDED = 2


def close_process_group_at_exit() -> None:
    """Close the process group when the interpreter exits, for every backend. Registered once per process."""
    atexit.unregister(close_process_group)
    atexit.register(close_process_group)


# What an engine keeps of the process groups, dropped when they close (an engine registers its own).
_FORGET_WITH_PROCESS_GROUP: list[Callable[[], None]] = []


def forget_with_process_group(forget: Callable[[], None]) -> None:
    """`forget` runs each time the process group closes (close_process_group): an engine that cached its groups
    drops them, so the next run in this interpreter builds its own."""
    if forget not in _FORGET_WITH_PROCESS_GROUP:
        _FORGET_WITH_PROCESS_GROUP.append(forget)


def close_process_group() -> None:
    """Destroy the process groups, if any, then give their threads the GIL until they have all gone quiet."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        for forget in _FORGET_WITH_PROCESS_GROUP:
            forget()
        wait_for_other_threads_to_settle()


def wait_for_other_threads_to_settle(deadline_s: float = THREADS_SETTLE_DEADLINE_S) -> float:
    """Sleep (the GIL released) until no other thread of this process is running or runnable for two polls in a
    row, or until `deadline_s`; returns the seconds waited. A worker waiting for the GIL is woken by our sleeping,
    takes it, and is asleep again by the next poll. Where /proc is not there to ask, waits one poll interval."""
    started = time.monotonic()
    quiet_polls = 0
    while quiet_polls < _QUIET_POLLS_NEEDED and time.monotonic() - started < deadline_s:
        time.sleep(_POLL_S)
        busy = busy_threads()
        if busy is None:
            break
        quiet_polls = 0 if busy else quiet_polls + 1
    return time.monotonic() - started


def busy_threads() -> list[int] | None:
    """Native ids of this process's other threads that are running or runnable; None without /proc."""
    tasks = Path(f"/proc/{os.getpid()}/task")
    if not tasks.is_dir():
        return None
    me = threading.get_native_id()
    busy = []
    for task in tasks.iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended while we looked
            continue
        # The state follows the command name, which is in parentheses and may itself hold spaces or parentheses.
        if int(task.name) != me and stat[stat.rindex(")") + 2] == "R":
            busy.append(int(task.name))
    return busy
