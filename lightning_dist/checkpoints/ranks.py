"""What checkpoint code needs of the strategy that runs it: the ranks, and a way to agree between them."""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

import torch

T = TypeVar("T")


class Ranks(Protocol):
    """A running strategy, as the checkpoint code sees it (Lightning's `Strategy` has all of this)."""

    is_global_zero: bool
    global_rank: int
    local_rank: int
    world_size: int
    root_device: torch.device
    lightning_module: Any

    def broadcast(self, obj: T, src: int = 0) -> T: ...

    def barrier(self, name: str | None = None) -> None: ...

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool: ...


class DeepSpeedRanks(Ranks, Protocol):
    """The DeepSpeed strategy's ranks: its engine and its resolved config as well."""

    deepspeed_engine: Any
    config: dict[str, Any]
