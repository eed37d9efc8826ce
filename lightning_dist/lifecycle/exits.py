"""How a run ends: its exit codes, `exit_with` (one line), and what a run refused elsewhere undoes before it goes.

The edge (lightning_dist/run/) says what a run leaves behind; this floor only ends processes. So the edge registers
its undoing here (`undo_on_refusal`), and a thread of this floor that must end the process at once, because another
rank refused the run (collective_timeout.py), calls it without importing the edge.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from lightning_dist.lifecycle.error_line import say_error

# A run's exit codes (docs/faults.md, "Exit codes of train.py"); a preemption's and a stop's are stop_signals.py's.
FINISHED, FAILED, REFUSED = 0, 1, 2

_undoings: list[Callable[[], None]] = []


def exit_code(error: BaseException) -> int:
    """The code the run exits with when `error` ends it: the error's own `exit_code` (a refusal's 2, a run with
    nothing left to train's 0), a SystemExit's (a preemption's 75), else 1."""
    if isinstance(error, SystemExit):
        return error.code if isinstance(error.code, int) else FAILED
    return getattr(error, "exit_code", FAILED)


def exit_with(error: Exception, code: int = REFUSED) -> None:
    """End the run with `error` in one line; after a stop signal, as the stop: the error may be the signal's doing
    (stop_signals.py, `leaving_as_the_stop`)."""
    from lightning_dist.lifecycle.stop_signals import stopped

    if (stop := stopped()) is not None:
        raise stop from error
    say_error(str(error))
    if code == REFUSED:  # refused before launch: a torchrun job's other ranks stop too, not after their timeout
        from lightning_dist.lifecycle.job_store import tell_refusal

        tell_refusal(str(error))
    sys.exit(code)


def undo_on_refusal(undo: Callable[[], None]) -> None:
    """`undo` runs when another rank refused this run and this process ends at once (the run directory's claim)."""
    if undo not in _undoings:
        _undoings.append(undo)


def undo_refused_run() -> None:
    """What the edge registered, each at most once and quietly: the process ends next, with its line said."""
    while _undoings:
        try:
            _undoings.pop()()
        except Exception:  # noqa: BLE001
            pass
