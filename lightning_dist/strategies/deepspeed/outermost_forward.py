"""DeepSpeed's hooks on the root module, run once per forward although Lightning runs the root inside itself.

Lightning calls `training_step` through the engine's forward (forward redirection), so the root LightningModule
runs twice per step: once around `training_step`, and again when `training_step` calls `self(...)`. DeepSpeed hangs
per-forward work on the root module's hooks, and each of them then fires twice, nested:

- the engine's prologue and epilogue start and stop the forward timers (`wall_clock_breakdown`, autotuning:
  "fwd_microstep timer has already been started"), start and stop the flops profiler, and mark ZeRO-3 parameters as
  in use for the duration of the forward (the inner epilogue unmarked them while the outer forward still ran);
- ZeRO-3 restarts its prefetch trace at every root forward: the inner call restarted it mid-step, every step's trace
  disagreed with the recorded one, DeepSpeed dropped it and fetched every parameter synchronously (about 20% slower).

Each of those hooks is made to fire for the outermost root call only, as in a hand-written loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_dist._compat.torch import forward_hook_tables


def run_root_hooks_once_per_forward(engine: Any) -> int:
    """Guard the engine's root-module hooks (prologue, epilogue, ZeRO-3's trace restart) so that only the outermost
    call of the root runs them; returns how many hooks were guarded."""
    root: nn.Module = engine.module
    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None) or getattr(
        engine, "parameter_offload", None
    )
    handles = [
        getattr(engine, "module_forward_pre_hook", None),
        getattr(engine, "module_forward_post_hook", None),
        getattr(offload, "fwd_pre_hook", None),
    ]
    depth = 0

    def outermost_only(hook: Callable) -> Callable:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            return hook(*args, **kwargs) if depth == 1 else None
        return guarded

    guarded = 0
    for handle in filter(None, handles):
        for hooks in forward_hook_tables(root):
            if handle.id in hooks:  # same id: with_kwargs/always_call flags stay as DeepSpeed registered them
                hooks[handle.id] = outermost_only(hooks[handle.id])
                guarded += 1
    if not guarded:
        return 0

    def enter(module: nn.Module, args: Any) -> None:
        nonlocal depth
        depth += 1

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        nonlocal depth
        depth -= 1

    root.register_forward_pre_hook(enter, prepend=True)  # before every guarded pre-hook
    root.register_forward_hook(leave, always_call=True)  # after every guarded post-hook, even when forward raises
    return guarded
