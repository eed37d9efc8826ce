"""CPython internals. Checked on CPython 3.10 to 3.13: what the interpreter itself calls at exit, in its order
(`threading._shutdown`, then `atexit._run_exitfuncs`), the one way to do an exit's work without finalizing the
interpreter."""

from __future__ import annotations

import atexit
import threading

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
