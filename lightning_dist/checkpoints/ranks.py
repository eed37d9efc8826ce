"""What checkpoint code needs of the strategy that runs it: the ranks, and a way to agree between them."""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

import torch

T = TypeVar("T")


class Ranks(Protocol):
    """A running strategy, as the checkpoint code sees it (Lightning's `Strategy` has all of this)."""

    @property
    def is_global_zero(self) -> bool: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def local_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def lightning_module(self) -> Any: ...

    def broadcast(self, obj: T, src: int = 0) -> T: ...

    def barrier(self, name: str | None = None) -> None: ...

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool: ...
