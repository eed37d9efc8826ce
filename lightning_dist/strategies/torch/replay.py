"""How the dry run replays torch's strategies (strategies/base.py's `dry_run_rank`). The replay itself, with fake
tensors and memory trackers, loads only when a dry run asks for it (dry_run.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from lightning_dist.dry_run.ranks import RankView


class ReplayedOnTorch:
    """Strategy mixin (first in the bases): one rank of the dry run, set up as DDP sets it up (the whole model,
    wrapped) or, where the strategy shards the model (`dry_run_shards`), as FSDP2 does (a mesh, then its shards)."""

    dry_run_shards: bool = False

    def dry_run_rank(self, build: Callable[[], nn.Module], batch: Any, precision: str, devices: int, num_nodes: int,
                     rank: int, device_type: str) -> RankView:
        from lightning_dist.strategies.torch.dry_run import rank_view

        return rank_view(self, build, batch, precision, devices, num_nodes, rank, device_type, self.dry_run_shards)
