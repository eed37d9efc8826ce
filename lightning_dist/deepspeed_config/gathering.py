"""How much of the model ZeRO-3 keeps gathered, sized from the model for our presets.

DeepSpeed's defaults keep up to 1e9 gathered parameters live (`stage3_max_live_parameters`) and do not release a
parameter that will be used again within 1e9 elements (`stage3_max_reuse_distance`). For any model under 1e9
parameters that means nothing is released during forward: every block stays gathered until backward, the whole
model at once, which is what ZeRO-3 exists to avoid. Sized here from the model's repeated blocks (the children of
its `nn.ModuleList`s, as Hugging Face and nanoGPT keep their layers): at most the block in use and the next one,
prefetched, are live, and a block is kept for reuse only when its next use is within one block (at the turn from
forward to backward). The planner counts the same two blocks.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from torch import nn

LIVE_BLOCKS = 2  # the block in use and the next one, prefetched


def largest_block(modules: Iterable[nn.Module]) -> int:
    """Elements of the largest child of any `nn.ModuleList`: the model's repeated layers; 0 when it has none."""
    return max(
        (sum(p.numel() for p in child.parameters()) for module in modules if isinstance(module, nn.ModuleList)
         for child in module),
        default=0,
    )


def gathering_sized_by_model(config: dict[str, Any], modules: Iterable[nn.Module]) -> dict[str, Any]:
    """`config` with ZeRO-3's live-parameter limit and reuse distance set from the model's largest block; unchanged
    for other stages or a model without repeated blocks."""
    zero = config.get("zero_optimization") or {}
    block = largest_block(modules)
    if zero.get("stage") != 3 or not block:
        return config
    config = copy.deepcopy(config)
    config["zero_optimization"].update(
        stage3_max_live_parameters=LIVE_BLOCKS * block,
        stage3_max_reuse_distance=block,
    )
    return config
