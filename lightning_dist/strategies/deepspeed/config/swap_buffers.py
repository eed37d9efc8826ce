"""ZeRO-Infinity's parameter swap pool, sized from the model rather than DeepSpeed's fixed defaults.

With parameters on NVMe, every parameter partition that is in use (being gathered, prefetched, or kept for reuse)
occupies one buffer of a fixed pool: `offload_param.buffer_count` buffers of `buffer_size` elements each, pinned
host memory. DeepSpeed's defaults (5 buffers of 1e8 elements, and up to 1e9 parameters kept in host memory
besides) cost 2 GB per rank whatever the model, yet run out of buffers on a model with many large layers, because
its reuse window (`stage3_max_reuse_distance`, 1e9 elements) keeps whole layers' partitions live. Sized here:

- `buffer_size`: the largest partition that is swapped at all;
- the reuse window (`stage3_max_reuse_distance`): one largest parameter, so a bounded number of partitions is kept
  live (DeepSpeed prefetches from the drive only into free buffers, so prefetching needs no bound of its own);
- `buffer_count`: an upper bound on that number (the smallest swapped parameters filling the window, plus the most
  any one module fetches at once, plus slack for the parameter crossing the window's edge and prefetches);
- `max_in_cpu`: 0, so the parameters live on the drive, which is what the preset asks for.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

# DeepSpeed swaps a partition only when it is at least this large (deepspeed.runtime.swap_tensor.utils.MIN_AIO_BYTES,
# or the aio block size when larger); smaller ones stay in host memory.
MIN_SWAPPED_BYTES = 1024**2
# DeepSpeed's stage3_param_persistence_threshold default: parameters this small are never partitioned.
DEFAULT_PERSISTENCE_THRESHOLD = 100_000
EDGE_SLACK = 4  # the parameter crossing the window's edge, and partitions in flight to or from the drive


@dataclass(frozen=True)
class SwapPool:
    buffer_count: int
    buffer_size: int      # elements: the largest swapped partition
    reuse_distance: int   # elements: one largest parameter


def parameter_swap_pool(
    sizes: Iterable[int], most_per_module: int, world_size: int, element_size: int, persistence_threshold: int
) -> SwapPool | None:
    """The pool for parameters of these `sizes` (elements), or None when no partition is large enough to be swapped.
    `most_per_module`: the most parameters any one module owns directly (fetched together)."""
    swapped = sorted(
        n for n in sizes
        if n > persistence_threshold and math.ceil(n / world_size) * element_size >= MIN_SWAPPED_BYTES
    )
    if not swapped:
        return None
    window = swapped[-1]
    count = most_per_module + _fitting_in(window, swapped) + EDGE_SLACK
    return SwapPool(count, math.ceil(window / world_size), window)


def swap_buffers_sized_by_model(
    config: dict[str, Any], modules: Iterable[torch.nn.Module], world_size: int
) -> dict[str, Any]:
    """`config` with its ZeRO-3 `offload_param` pool sized for these modules (see the module docstring); unchanged
    unless parameters are offloaded to NVMe."""
    zero = config.get("zero_optimization") or {}
    if (zero.get("offload_param") or {}).get("device") != "nvme":
        return config
    modules = list(modules)
    parameters = {id(p): p for module in modules for p in module.parameters(recurse=False)}.values()
    pool = parameter_swap_pool(
        (p.numel() for p in parameters),
        max(len(list(module.parameters(recurse=False))) for module in modules),
        world_size,
        partition_element_size(config),
        persistence_threshold(zero),
    )
    if pool is None:
        return config
    config = copy.deepcopy(config)
    zero = config["zero_optimization"]
    zero["stage3_max_reuse_distance"] = pool.reuse_distance
    zero["offload_param"].update(buffer_size=pool.buffer_size, buffer_count=pool.buffer_count, max_in_cpu=0)
    return config


def partition_element_size(config: dict[str, Any]) -> int:
    """Bytes per element of ZeRO-3's parameter partitions: they are kept in the training dtype."""
    half = any((config.get(key) or {}).get("enabled") is True for key in ("fp16", "bf16"))
    return 2 if half else 4


def persistence_threshold(zero: dict[str, Any]) -> int:
    threshold = zero.get("stage3_param_persistence_threshold", DEFAULT_PERSISTENCE_THRESHOLD)
    return DEFAULT_PERSISTENCE_THRESHOLD if threshold == "auto" else int(threshold)


def _fitting_in(window: int, sizes: list[int]) -> int:
    """How many of the smallest `sizes` (sorted) fit together in `window` elements."""
    total = count = 0
    for size in sizes:
        total += size
        if total > window:
            break
        count += 1
    return count
