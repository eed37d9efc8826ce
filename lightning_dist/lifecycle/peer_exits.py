"""Why another rank left, for the rank whose connection to it closed mid-run.

A rank leaving with an error says so, with its exit code, in the process group's own store (hosted by global rank 0,
or by the torchrun agent of node 0) before its connections close; a rank that then loses its connection reads it
there and names the rank, its code and its reason, instead of "connection closed by peer". A rank that only lost its
connection to another says nothing there: the first to read it would take it for the cause.

A rank killed by a signal says nothing, and neither can one whose store went with it (global rank 0's, outside
torchrun). The process that started a node's ranks (Lightning's launcher) knows how each ended, and a stopped one
(SIGSTOP) is in the kernel's process table: those are named from there (`first_ended`, `first_stopped`). Otherwise
the line says only that a rank exited or was killed.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from lightning_dist.lifecycle.stop_signals import LAUNCHER_ENV

_LEFT = "lightning_dist/ranks_left"
# Reading or writing a store whose host is gone must not hold up a rank that is leaving anyway.
_STORE_BOUND_S = 3.0
_REASON_CHARS = 300


def say_leaving(code: int, error: BaseException) -> None:
    """This rank leaves the run with `code` because of `error`: recorded for the ranks it leaves behind. Call it before
    the process group closes; nothing is said for a clean exit or outside a process group of several ranks."""
    if code == 0 or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    if getattr(error, "caused_elsewhere", False):  # a rank that lost another: the first to read must not blame it
        return
    first_line = (str(error).splitlines() or [""])[0][:_REASON_CHARS]
    said = f"rank {dist.get_rank()} exited with code {code} ({type(error).__name__}: {first_line})"

    def record(store: Any) -> None:
        store.set(f"{_LEFT}/{store.add(_LEFT, 1)}", said)

    _bounded(lambda: record(_default_store()))


def rank_ended(rank: int, returncode: int, pid: int) -> str:
    """How a rank this process started ended, as the launcher saw it: `rank 2 (pid 4242 on node-a) was killed by
    SIGKILL`, or `... exited with code 1`."""
    how = f"was killed by {_signal_name(-returncode)}" if returncode < 0 else f"exited with code {returncode}"
    return f"rank {rank} (pid {pid} on {socket.gethostname()}) {how}"


def first_ended(processes: list, first_rank: int) -> str | None:
    """Of the ranks this process started (`processes`, global ranks from `first_rank` on), how the one that ended the
    run ended (`first_failed`); None while every one runs or ended cleanly."""
    if (failed := first_failed(processes)) is None:
        return None
    index, code = failed
    return rank_ended(first_rank + index, code, processes[index].pid)


def first_failed(processes: list) -> tuple[int, int] | None:
    """The index and return code of the process that ended the run: one killed by a signal before one that exited
    with an error (which may have lost its connection to it); None while every one runs or ended cleanly."""
    ended = [(index, code) for index, process in enumerate(processes)
             if (code := _returncode(process)) is not None and code != 0]
    return min(ended, key=lambda found: (found[1] >= 0, found[0])) if ended else None


def first_stopped(ranks: dict[int, int]) -> str | None:
    """Of the ranks on this node (`ranks`: global rank -> pid), one stopped by a signal (SIGSTOP, SIGTSTP: the
    kernel's state T), which holds every collective until the timeout: `rank 2 (pid 4242 on node-a) is stopped`."""
    for rank, pid in sorted(ranks.items()):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                state = stat.read().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue
        if state in ("T", "t"):
            return f"rank {rank} (pid {pid} on {socket.gethostname()}) is stopped (SIGSTOP or SIGTSTP)"
    return None


def ranks_on_this_node(started: list, global_rank: int, local_rank: int) -> dict[int, int]:
    """Global rank -> pid of this node's ranks that one process started (Lightning's launcher: local rank 0, which
    started local ranks 1, 2, ... in order), as seen from any of them: `started`, this process's own (on the
    launcher), else its launcher and the launcher's other children, by the local rank in their environment."""
    node_zero = global_rank - local_rank
    if started:
        return {global_rank: os.getpid(), **{global_rank + 1 + index: p.pid for index, p in enumerate(started)}}
    launcher = os.environ.get(LAUNCHER_ENV)
    if not launcher:
        return {}
    ranks = {node_zero: int(launcher)}
    try:
        with open(f"/proc/{launcher}/task/{launcher}/children") as children:
            pids = [int(pid) for pid in children.read().split()]
    except OSError:
        return ranks
    for pid in pids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as environ:
                local = dict(item.partition(b"=")[::2] for item in environ.read().split(b"\0")).get(b"LOCAL_RANK")
        except OSError:
            continue
        if local is not None:
            ranks[node_zero + int(local)] = pid
    return ranks


def _returncode(process: Any) -> int | None:
    poll = getattr(process, "poll", None)  # subprocess.Popen; a forked multiprocessing.Process has `exitcode`
    return poll() if poll is not None else getattr(process, "exitcode", None)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def said_leaving() -> str | None:
    """What the first rank to leave with an error said ("rank 1 exited with code 1 (RuntimeError: ...)"), if any."""
    if not (dist.is_available() and dist.is_initialized()):
        return None

    def first(store: Any) -> str | None:
        key = f"{_LEFT}/1"
        return store.get(key).decode() if store.add(_LEFT, 0) and store.check([key]) else None

    return _bounded(lambda: first(_default_store()))


def _default_store() -> Any:
    from lightning_dist._compat.torch import default_process_group_store

    return default_process_group_store()


def _bounded(ask: Callable[[], Any]) -> Any:
    """`ask()`, or None if it fails or takes longer than `_STORE_BOUND_S` (left to finish in the background)."""
    answer: list[Any] = [None]

    def run() -> None:
        try:
            answer[0] = ask()
        except Exception:  # noqa: BLE001  the store's host is gone: nothing to say, or to read
            pass

    thread = threading.Thread(target=run, name="peer-exits", daemon=True)
    thread.start()
    thread.join(_STORE_BOUND_S)
    return answer[0]
