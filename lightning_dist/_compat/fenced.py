"""What a fenced name is: the record each library's module of the fence lists its internals in."""

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
