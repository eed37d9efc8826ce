"""DeepSpeed's slice: the strategy (strategy.py), its config and the rules that resolve it (config/), the engine's
set-up and patches (engine.py, zero3_runtime.py, autotp.py, deferred_compile.py, outermost_forward.py), the
offloaded optimizer (offload.py), checkpoint loading (load.py, universal.py), the planner's terms (layout.py) and
the dry run's replay (dry_run.py). Nothing outside strategies/ imports it.

`DeepSpeedStrategy` loads on first use, so that the config's rules (no torch) load without the engine.
"""

from typing import Any

__all__ = ["DeepSpeedStrategy"]


def __getattr__(name: str) -> Any:
    if name == "DeepSpeedStrategy":
        from lightning_dist.strategies.deepspeed.strategy import DeepSpeedStrategy

        return DeepSpeedStrategy
    raise AttributeError(f"module 'lightning_dist.strategies.deepspeed' has no attribute {name!r}")
