"""How much of the model ZeRO-3 keeps gathered, sized from the model for our presets.

DeepSpeed's defaults keep up to 1e9 gathered parameters live (`stage3_max_live_parameters`) and do not release a
parameter that will be used again within 1e9 elements (`stage3_max_reuse_distance`). For any model under 1e9
parameters that means nothing is released during forward: every block stays gathered until backward, the whole
model at once, which is what ZeRO-3 exists to avoid. Sized here from the model's repeated blocks (`block_modules`:
the layers of its `nn.ModuleList` stacks, as Hugging Face and nanoGPT keep them): at most the block in use and the
next one, prefetched, are live, and a block is kept for reuse only when its next use is within one block (at the
turn from forward to backward). The planner counts the same two blocks of the same definition.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from lightning_dist.parallel.classes import block_modules

LIVE_BLOCKS = 2  # the block in use and the next one, prefetched


def largest_block(model: nn.Module) -> int:
    """Elements of the model's largest block; 0 when it has none."""
    return max((sum(p.numel() for p in block.parameters()) for block in block_modules(model)), default=0)


def gathering_sized_by_model(config: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """`config` with ZeRO-3's live-parameter limit and reuse distance set from the model's largest block; unchanged
    for other stages or a model without repeated blocks."""
    zero = config.get("zero_optimization") or {}
    block = largest_block(model)
    if zero.get("stage") != 3 or not block:
        return config
    config = copy.deepcopy(config)
    config["zero_optimization"].update(
        stage3_max_live_parameters=LIVE_BLOCKS * block,
        stage3_max_reuse_distance=block,
    )
    return config
