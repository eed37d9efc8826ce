"""A toy parallel axis, added as a new axis lands: a field of ParallelDims and a row of its AXES. Nothing in the
package changes for it (tests/parallel/test_dims.py)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_dist.parallel.dims import Axis, ParallelDims


@dataclass(frozen=True)
class WithToyAxis(ParallelDims):
    toy: int = 1
    # Between the data and tensor parallelism: its ranks read the same batches, as tensor-parallel ones do.
    AXES = (*ParallelDims.AXES[:-1], Axis("toy", "toy_parallel"), ParallelDims.AXES[-1])
