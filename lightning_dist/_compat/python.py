"""CPython internals. Checked on CPython 3.10 to 3.13: what the interpreter itself calls at exit, in its order
(`threading._shutdown`, then `atexit._run_exitfuncs`), the one way to do an exit's work without finalizing the
interpreter; and the running frames, to tell who registers a parameter (a module's constructor, or a library)."""

from __future__ import annotations

import atexit
import inspect
import threading
from collections.abc import Iterable, Iterator
from types import FrameType

from lightning_dist._compat.fenced import Fenced

FENCED = [Fenced("atexit", "_run_exitfuncs"), Fenced("threading", "_shutdown", ())]


def join_threads_as_at_exit() -> None:
    """What an exit does first, from the main thread: the threading module's exit callbacks (which tell a
    `concurrent.futures` pool's workers to finish: torch.compile keeps such a pool), then every non-daemon thread
    joined. Joining the threads without the callbacks waits forever on a pool's idle workers."""
    threading._shutdown()


def run_exit_handlers() -> None:
    """Every `atexit` handler, last registered first, as at a normal exit; each runs once."""
    atexit._run_exitfuncs()


def calling_frames() -> Iterator[FrameType]:
    """The frames of the caller's caller and out (`inspect.currentframe`: CPython's frames)."""
    frame = inspect.currentframe()
    frame = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
    while frame is not None:
        yield frame
        frame = frame.f_back


def constructing(obj: object, frames: Iterable[FrameType]) -> bool:
    """Whether one of `frames` is `obj`'s own `__init__` (its first argument is `obj`)."""
    for frame in frames:
        code = frame.f_code
        if code.co_name == "__init__" and code.co_argcount and frame.f_locals.get(code.co_varnames[0]) is obj:
            return True
    return False


def in_package(package: str, frames: Iterable[FrameType]) -> bool:
    """Whether code of `package` (its modules, by name) runs in one of `frames`."""
    prefix = package + "."
    return any((name := frame.f_globals.get("__name__", "")) == package or name.startswith(prefix) for frame in frames)
