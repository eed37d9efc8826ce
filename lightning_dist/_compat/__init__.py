"""The fence around library internals. Every private name of torch, Lightning, DeepSpeed, Hydra or CPython that the
package needs, and every patch it applies to them, goes through a named function here (one module per library), with the
public API that is missing and the versions it was checked on. An upgrade that breaks one breaks here, in one place:
`tests/test_compat_fence.py` checks that each fenced symbol still exists with the parameters we rely on, and that
nothing outside this package reaches past the fence.

The submodules are imported where they are used, not here: the CLI reads Hydra's grammar before torch is loaded.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Fenced:
    """One internal symbol: `module`'s attribute `name` (dotted), taking at least `parameters` (in this order)."""

    module: str
    name: str
    parameters: tuple[str, ...] | None = None

    def resolve(self) -> Any:
        found: Any = importlib.import_module(self.module)
        for part in self.name.split("."):
            found = getattr(found, part)
        return found


def fenced() -> list[Fenced]:
    """Every symbol behind the fence, from each library's module."""
    from lightning_dist._compat import deepspeed, fake_tensors, hydra, lightning, python, torch

    return [*torch.FENCED, *fake_tensors.FENCED, *lightning.FENCED, *deepspeed.FENCED, *hydra.FENCED, *python.FENCED]
