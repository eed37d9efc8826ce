"""Simulation: a run at the world size you will launch, in this one process, on fake tensors over torch's fake
process group. `ranks` drives ddp and FSDP and says what each rank holds (`dry_run=true`, and `dry_run` under
plain Lightning), `deepspeed` does the same for ZeRO's engine, and `fake_loop` runs Lightning's whole loop as one
rank on fake CUDA devices. The names load on first use: importing the package loads no torch.
"""

from typing import Any

_FROM_RANKS = ("RankView", "can_dry_run", "dry_run", "dry_run_configured", "dry_run_devices", "dry_run_ranks",
               "dry_run_refusal",
               "FakeRankEnvironment", "table")

__all__ = list(_FROM_RANKS)


def __getattr__(name: str) -> Any:
    if name in _FROM_RANKS:
        from lightning_dist.dry_run import ranks

        return getattr(ranks, name)
    raise AttributeError(f"module 'lightning_dist.dry_run' has no attribute {name!r}")
