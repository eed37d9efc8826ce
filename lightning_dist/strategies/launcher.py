"""A launcher that checks a run on the launching process before any rank starts, then launches as before."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.trainer.states import TrainerFn


class PreflightError(ValueError):
    """A run that cannot start, found before any rank was spawned; the message names what to change."""


class PreflightLauncher(_Launcher):
    """Wraps Lightning's launcher: `preflight(trainer, fit_arguments)` runs first when fitting.

    Lightning spawns the other ranks at the start of `trainer.fit`; a mistake found after that costs every rank
    its start-up and prints one traceback per rank, so the checks that need only the Trainer, the module and the
    data run here, once.
    """

    def __init__(self, launcher: _Launcher, preflight: Callable[[Any, dict[str, Any]], None]) -> None:
        self.launcher = launcher
        self.preflight = preflight

    @property
    def is_interactive_compatible(self) -> bool:
        return self.launcher.is_interactive_compatible

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            arguments = inspect.signature(function).bind(*args, **kwargs).arguments
            try:
                self.preflight(trainer, arguments)
            except (ValueError, TypeError) as error:
                raise PreflightError(str(error)) from error
        return self.launcher.launch(function, *args, trainer=trainer, **kwargs)

    def kill(self, signum: Any) -> None:
        self.launcher.kill(signum)

    def __getattr__(self, name: str) -> Any:  # e.g. `procs` of the subprocess launcher
        return getattr(self.launcher, name)
