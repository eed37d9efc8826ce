"""A logged value averaged over the ranks at the steps the loggers write it, so that a curve means the same at any
data-parallel size.

Lightning logs rank 0's own value unless `sync_dist=True`, which averages it over every rank at every call: a
collective per logged value per step, whether the loggers write that step or not. `mean_when_logged(self, loss)`
averages at the steps the loggers write (every `trainer.log_every_n_steps`, and when the run stops) and is the rank's
own value at the others, where nothing reads it but the progress bar: the quiet steps gain no collective.

It averages over every rank, which is the mean over the data-parallel ranks wherever the other axes' ranks hold one
value (tensor parallelism; a pipeline's stages, which all log the last stage's) or equal shares of it (the shards of
a sequence under context parallelism, whose losses are averaged over their group as they are logged). On a
pipeline's last stage the step runs alone, where a collective would wait for the other stages forever: there the
value is marked, and averaged when every stage logs it (strategies/torch/pipeline.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from lightning_dist._compat.lightning import attached_trainer, logs_this_step

# The modules whose step is running on a pipeline's last stage alone, and the mark their means carry until every
# stage logs them.
_DEFERRING: weakref.WeakSet[Any] = weakref.WeakSet()
_MARK = "lightning_dist_mean_when_logged"


def mean_when_logged(module: Any, value: torch.Tensor | float) -> torch.Tensor | float:
    """`value` averaged over the ranks at the steps `module`'s loggers write (detached, in float32); as it is at the
    others, and wherever there is one rank. For `module.log(name, mean_when_logged(module, value))`."""
    trainer = attached_trainer(module)
    if trainer is None or not dist.is_initialized() or dist.get_world_size() == 1 or not logs_this_step(trainer):
        return value
    value = torch.as_tensor(value, device=module.device).detach().float()
    if module in _DEFERRING:
        marked = value.clone()
        setattr(marked, _MARK, True)
        return marked
    return mean_over_ranks(value)


def mean_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """The mean of `values` over every rank, on the device (gloo has no AVG: a sum, divided)."""
    total = values.detach().float().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


@contextmanager
def means_deferred(module: Any) -> Iterator[None]:
    """While `module`'s step runs on a pipeline's last stage alone: `mean_when_logged` marks its value instead of
    averaging it."""
    _DEFERRING.add(module)
    try:
        yield
    finally:
        _DEFERRING.discard(module)


def is_deferred_mean(value: Any) -> bool:
    """Whether `value` is a mean `mean_when_logged` left to be taken when every stage logs it."""
    return getattr(value, _MARK, False) is True
