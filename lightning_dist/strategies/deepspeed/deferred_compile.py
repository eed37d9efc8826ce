"""DeepSpeed 0.19.8's ZeRO optimizers import its Muon optimizer while they are built (to ask whether the client
optimizer is one), and that module compiles three functions with `torch.compile` as it is imported. Wrapping a
function in `torch.compile` imports the compiler's stack (about 650 modules: inductor, functorch's partitioners,
networkx), which cost every rank 1.5 s and 46 MB at start-up on the default model: most of what put ZeRO-3's peak
memory above DDP's. Importing the module with the compilation deferred to the first call gives DeepSpeed the
same classes, and a run that really uses Muon compiles on its first step instead of at import."""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any, Callable

import torch

MUON_MODULES = ("deepspeed.runtime.zero.muon.original_muon", "deepspeed.runtime.zero.muon.muon_optimizer")


def import_muon_with_deferred_compilation() -> None:
    """Idempotent: a module imported already (by this, by the user, or by DeepSpeed) is left as it is."""
    if all(name in sys.modules for name in MUON_MODULES):
        return
    from lightning_dist._compat.deepspeed import compile_replaced_by

    with compile_replaced_by(compile_on_first_call):
        for name in MUON_MODULES:
            importlib.import_module(name)


def compile_on_first_call(function: Callable | None = None, **options: Any) -> Callable:
    """`torch.compile`, with the compiler's imports and the compilation deferred to the first call."""
    if function is None:
        return functools.partial(compile_on_first_call, **options)
    compiled: Callable | None = None

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(function, **options)
        return compiled(*args, **kwargs)

    return call
