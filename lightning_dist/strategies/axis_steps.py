"""Strategy mixin, the last of `StrategyBase`'s: each step and each backward runs through the parallel axes that act
on this rank's steps (`step_axes()`, outermost first), then Lightning's own. An axis takes the step it is handed
(Lightning's, or the next axis's) and runs it on its part of the batch, or runs the step itself: context parallelism
runs it on the rank's shard of each sequence with attention exchanged (parallel/context_parallel.py), pipeline
stages run the user's step through their schedule instead (strategies/torch/pipeline.py). A strategy with no such
axis set up steps as Lightning's does.

Inside the other mixins (compile's eager sanity check wraps the step), around Lightning's step and backward."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from lightning_dist._compat.lightning import StrategyMixin

STEPS = ("training_step", "validation_step", "test_step")


class StepAxis(Protocol):
    """What a parallel axis does to one rank's steps."""

    def run_step(self, strategy: Any, kind: str, run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Step `kind` (one of `STEPS`) with the step's arguments; `run` is the step it wraps."""

    def run_backward(self, strategy: Any, closure_loss: Any, run: Callable[[], Any]) -> Any:
        """Backward of `closure_loss`; `run` is the backward it wraps."""


class StepsThroughAxes(StrategyMixin):
    def step_axes(self) -> list[StepAxis]:
        """The axes set up on this rank that act on its steps, outermost first (each strategy says its own)."""
        return []

    def _through_axes(self, kind: str, run: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        for axis in reversed(self.step_axes()):
            run = partial(axis.run_step, self, kind, run)
        return run(*args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._through_axes("training_step", super().training_step, args, kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._through_axes("validation_step", super().validation_step, args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._through_axes("test_step", super().test_step, args, kwargs)

    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        run = partial(super().backward, closure_loss, optimizer, *args, **kwargs)
        for axis in reversed(self.step_axes()):
            run = partial(axis.run_backward, self, closure_loss, run)
        return run()
