"""CPython internals. Checked on CPython 3.10 to 3.13 (`atexit._run_exitfuncs` is what the interpreter itself calls at
exit, and the one way to run the registered handlers without finalizing the interpreter)."""

from __future__ import annotations

import atexit

from lightning_dist._compat import Fenced

FENCED = [Fenced("atexit", "_run_exitfuncs")]


def run_exit_handlers() -> None:
    """Every `atexit` handler, last registered first, as at a normal exit; each runs once."""
    atexit._run_exitfuncs()
