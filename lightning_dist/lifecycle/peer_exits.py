"""Why another rank left, for the rank whose connection to it closed mid-run.

A rank leaving with an error says so, with its exit code, in the process group's own store (hosted by global rank 0,
or by the torchrun agent of node 0) before its connections close; a rank that then loses its connection reads it
there and names the rank, its code and its reason, instead of "connection closed by peer". A rank killed by a signal
says nothing, and neither can one whose store went with it (global rank 0's, outside torchrun): the line then says
only that a rank exited or was killed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

_LEFT = "lightning_dist/ranks_left"
# Reading or writing a store whose host is gone must not hold up a rank that is leaving anyway.
_STORE_BOUND_S = 3.0
_REASON_CHARS = 300


def say_leaving(code: int, error: BaseException) -> None:
    """This rank leaves the run with `code` because of `error`: recorded for the ranks it leaves behind. Call it before
    the process group closes; nothing is said for a clean exit or outside a process group of several ranks."""
    if code == 0 or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    first_line = (str(error).splitlines() or [""])[0][:_REASON_CHARS]
    said = f"rank {dist.get_rank()} exited with code {code} ({type(error).__name__}: {first_line})"

    def record(store: Any) -> None:
        store.set(f"{_LEFT}/{store.add(_LEFT, 1)}", said)

    _bounded(lambda: record(_default_store()))


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
