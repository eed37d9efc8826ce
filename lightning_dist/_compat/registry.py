"""Lightning's strategy registry, as our presets are in it: each as `ld_<name>`. Lightning is imported only when a
preset is asked for: the preset table imports this module from inside Lightning's own import (registration.py), while
Lightning is still half built.
"""

from __future__ import annotations

from typing import Any

# Our presets' names in Lightning's strategy registry (`L.Trainer(strategy="ld_fsdp")`): the prefix keeps Lightning's
# own `ddp`, `fsdp` and `deepspeed_*`, which refuse CPU, reachable and unchanged.
REGISTRY_PREFIX = "ld_"


def registered_strategy(preset: str, **overrides: Any) -> Any:
    """Preset `preset` built as Lightning's registry builds `ld_<preset>` (registered when lightning_dist is
    imported), with `overrides` over its arguments: how code below the strategies makes one without importing it."""
    from lightning.pytorch.strategies import StrategyRegistry

    entry = StrategyRegistry[REGISTRY_PREFIX + preset]
    return entry["strategy"](**{**entry["init_params"], **overrides})


def registered_arguments(preset: str) -> dict[str, Any]:
    """The arguments Lightning's registry builds `ld_<preset>` with."""
    from lightning.pytorch.strategies import StrategyRegistry

    return dict(StrategyRegistry[REGISTRY_PREFIX + preset]["init_params"])
