"""Each pipeline rank's idle share of its training steps, measured: the time its stages compute (the forward and
backward actions the schedule runs on them) against the time of the schedule's step. Beside the share the schedule
implies (`PipelineLayout.bubble_fraction`, equal work per stage and free transfers), it shows what the schedule
really leaves idle: uneven stages, transfers, the last stage's loss, the host's own work between actions.

On CPU by the host's clock; on CUDA by events recorded around each action on the current stream, read only when the
share is asked for (the training monitor asks at the steps it logs), so that a quiet step reads nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

# What a stage computes, by the methods torch's schedules call on it (`backward_weight_one_chunk`: the weight pass
# of a zero-bubble schedule, whose `backward_one_chunk` then computes the input gradients alone).
ACTIONS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
KEPT_STEPS = 1000  # the steps held until the share is asked for: a run without the monitor keeps no more


class IdleClock:
    """Times the actions of the stages it `watch`es inside each `step()`; `idle_share()` is the mean share of the
    steps since it was last asked for."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._steps: list[tuple[Any, Any, list[tuple[Any, Any]]]] = []
        self._actions: list[tuple[Any, Any]] | None = None  # the step in progress

    def watch(self, stage: Any) -> None:
        for name in ACTIONS:
            method = getattr(stage, name, None)
            if method is None:  # an older torch's stage, without the weight pass
                continue
            setattr(stage, name, self._timed(method))
        missing = [name for name in ACTIONS[:2] if not hasattr(getattr(stage, name, None), "timed_by")]
        if missing:  # a torch whose stages compute elsewhere would show every step idle: say so, never guess
            raise RuntimeError(f"pipeline idle time: torch {torch.__version__}'s PipelineStage has no {missing[0]}")

    @contextmanager
    def step(self) -> Iterator[None]:
        start, self._actions = self._mark(), []
        try:
            yield
        finally:
            self._steps.append((start, self._mark(), self._actions))
            self._actions = None
            del self._steps[:-KEPT_STEPS]

    def idle_share(self) -> float | None:
        """The mean over the steps timed since the last call of 1 - (the stages' compute / the step's time); None
        before a step was timed."""
        steps, self._steps = self._steps, []
        shares = []
        for start, stop, actions in steps:
            total = self._seconds(start, stop)
            busy = sum(self._seconds(begin, end) for begin, end in actions)
            shares.append(min(1.0, max(0.0, 1.0 - busy / total)) if total > 0 else 0.0)
        return sum(shares) / len(shares) if shares else None

    def _timed(self, action: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            actions = self._actions
            if actions is None:  # a held-out pass, or the schedule's own set-up: not a training step's
                return action(*args, **kwargs)
            begin = self._mark()
            try:
                return action(*args, **kwargs)
            finally:
                actions.append((begin, self._mark()))

        timed.timed_by = self  # type: ignore[attr-defined]
        return timed

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _seconds(self, begin: Any, end: Any) -> float:
        if not self.cuda:
            return end - begin
        end.synchronize()
        return begin.elapsed_time(end) / 1e3
