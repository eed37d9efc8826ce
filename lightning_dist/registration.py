"""`import lightning_dist` registers the `ld_*` presets with Lightning's strategy registry without importing
Lightning (and with it torch and DeepSpeed) itself, so that `python train.py --help` answers in a second.

If Lightning is loaded already, the presets are registered now; otherwise the moment `import lightning` finishes,
whichever module asks for it first. The top-level package, not `lightning.pytorch.strategies`: our strategies import
`lightning` themselves, which is complete only once its own `__init__` has run.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

LIGHTNING = "lightning"


def register_presets_with_lightning() -> None:
    if LIGHTNING in sys.modules:
        _register()
    elif not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(LIGHTNING, _register))


def _register() -> None:
    # The preset table imports nothing of ours: Lightning may have been imported by one of our modules, half built.
    from lightning_dist.strategies.presets import register_presets

    register_presets()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds `name` as the other finders would, and calls `then()` once the module has been executed. One shot: it
    leaves `sys.meta_path` when asked for the module (Python has no post-import hook of its own; PEP 369 was
    withdrawn)."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenCall(spec.loader, self.then)
        return spec


class _ThenCall(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, then: Callable[[], None]) -> None:
        self.loader, self.then = loader, then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        self.then()

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, is_package, resource readers...
        return getattr(self.loader, name)
