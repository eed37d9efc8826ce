"""Leave without the interpreter's teardown: the run's work is done, every `atexit` handler has run and every open
file is flushed, so what remains is freeing a torch process's objects one by one, about a second (measured: 1.0 s for
rank 1, then 1.0 s for rank 0, which waits for it first). Two seconds of every run, and of every test that runs one.

It also skips the moment the teardown can crash: a gloo worker thread that drops Python state after finalization
began aborts the process (process_exit.py).
"""

from __future__ import annotations

import ctypes
import fcntl
import gc
import io
import os
import stat
import sys
from contextlib import suppress
from typing import NoReturn

from lightning_dist._compat.python import join_threads_as_at_exit, run_exit_handlers


def exit_quickly(code: object) -> NoReturn:
    """Exit as `sys.exit(code)` would (non-daemon threads joined, `atexit` handlers run, buffers flushed, the same
    exit status), then end the process without finalizing the interpreter."""
    join_threads_as_at_exit()
    run_exit_handlers()
    status = _exit_status(code)
    _flush_open_files()
    os._exit(status)


def _exit_status(code: object) -> int:
    """The status the interpreter gives `SystemExit(code)`: None is 0, an int itself, anything else printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _flush_open_files() -> None:
    """What finalization would have written: every open Python file's buffer (a file a user's code left open
    included), then the C library's."""
    for stream in (sys.stdout, sys.stderr):
        with suppress(Exception):
            stream.flush()
    if _files_open_for_writing():  # looking through every object takes 0.4 s in a torch process: only when needed
        for obj in gc.get_objects():
            if issubclass(type(obj), io.IOBase):  # not isinstance: it reads `__class__`, which some objects warn on
                with suppress(Exception):
                    if not obj.closed and obj.writable():
                        obj.flush()
    with suppress(Exception):
        ctypes.CDLL(None).fflush(None)


def _files_open_for_writing() -> bool:
    """Whether a regular file is open for writing beyond the standard streams (True where the OS will not say)."""
    try:
        descriptors = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return True
    for fd in descriptors:
        with suppress(OSError):
            writable = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY
            if fd > 2 and writable and stat.S_ISREG(os.fstat(fd).st_mode):
                return True
    return False
