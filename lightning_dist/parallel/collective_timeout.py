"""A collective that waited past `strategy.timeout` for a rank that never came: one line naming the rank, the step
and the setting, instead of a backend's stack trace (gloo: "Timed out waiting 30000ms for recv operation")."""

from __future__ import annotations

import re
from typing import Any

_TIMEOUT_MESSAGE = re.compile(r"timed out|timeout", re.IGNORECASE)


class CollectiveTimeout(RuntimeError):
    """This rank gave up waiting in a collective: another rank is stuck, or slower than `strategy.timeout`."""


def explain_collective_timeout(error: BaseException, trainer: Any) -> CollectiveTimeout | None:
    """The CollectiveTimeout that `error` (raised out of `trainer.fit`) stands for, or None if it is another error."""
    if not isinstance(error, RuntimeError) or not _TIMEOUT_MESSAGE.search(str(error)):
        return None
    seconds = getattr(trainer.strategy, "_timeout", None)
    limit = f"strategy.timeout={seconds.total_seconds():g} s" if seconds is not None else "the process group's timeout"
    return CollectiveTimeout(
        f"rank {trainer.global_rank} waited in a collective at global step {trainer.global_step} longer than {limit}:"
        f" another rank did not reach it (stuck, or slower than the timeout); {str(error).splitlines()[0]}"
    )
