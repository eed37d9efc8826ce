"""A LightningModule whose optimizer and learning-rate schedule come from the `optimizer/` and `scheduler/` config
groups: each is a partial (`_target_` + `_partial_: true`, lightning-hydra-template's way) that the module calls.

    class MyModule(ConfiguredOptimizers, L.LightningModule):
        def __init__(self, optimizer=None, scheduler=None):
            super().__init__()
            self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import ReduceLROnPlateau

from lightning_dist._compat.lightning import ModuleMixin
from lightning_dist.optim.parameter_groups import decay_groups

OptimizerFactory = Callable[..., Optimizer]  # called with `params`
SchedulerFactory = Callable[..., Any]  # called with `optimizer`

# What `optimizer=adamw` (conf/optimizer/adamw.yaml) gives, for a module built in Python without a config.
DEFAULT_OPTIMIZER: OptimizerFactory = partial(
    torch.optim.AdamW, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01, fused=True
)

# Optimizers whose update needs each parameter whole: torch's Adafactor factors a matrix's second moment into row and
# column means. FSDP2 hands it shards (DTensors, which it has no rule for: it fails at the first step) and ZeRO flat
# partitions (it would fall back to an unfactored update: another optimizer than the one chosen).
WHOLE_PARAMETER_OPTIMIZERS: tuple[type[Optimizer], ...] = (torch.optim.Adafactor,)


def require_shardable_optimizer(model: Any, strategy: str) -> None:
    """Raises ValueError, naming `model.optimizer` and the choices, when `model`'s configured optimizer cannot step
    the parameter shards that `strategy` gives it."""
    factory = getattr(model, "optimizer_factory", None)
    target = factory.func if isinstance(factory, partial) else factory
    if isinstance(target, type) and issubclass(target, WHOLE_PARAMETER_OPTIMIZERS):
        raise ValueError(
            f"model.optimizer: {target.__name__} needs each parameter whole and {strategy} shards them;"
            " choose optimizer=adamw, adam, sgd or lion, or strategy=ddp"
        )


class ConfiguredOptimizers(ModuleMixin):
    """`configure_optimizers` from two factories: the optimizer over `decay_groups` (weight decay on matrices only),
    and a scheduler stepped after every optimizer step; a `ReduceLROnPlateau` instead steps once after each
    validation, on `monitor`."""

    optimizer_factory: OptimizerFactory | None = None
    scheduler_factory: SchedulerFactory | None = None
    monitor: str = "val_loss"  # what a plateau scheduler watches
    _validated_since_plateau_step = False

    def configure_optimizers(self) -> Any:
        optimizer = (self.optimizer_factory or DEFAULT_OPTIMIZER)(params=decay_groups(self))
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer=optimizer)
        if isinstance(scheduler, ReduceLROnPlateau):
            # Lightning offers plateau steps per epoch or every N batches of an epoch; validation here comes every
            # `val_check_interval` batches of the whole run. Asked at every step, `lr_scheduler_step` acts only
            # after a validation. Before the first one there is no metric: strict=False skips those steps.
            config = {"scheduler": scheduler, "interval": "step", "monitor": self.monitor, "strict": False}
        else:
            config = {"scheduler": scheduler, "interval": "step"}
        return {"optimizer": optimizer, "lr_scheduler": config}

    def on_validation_end(self) -> None:
        if not self.trainer.sanity_checking:
            self._validated_since_plateau_step = True

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        if not isinstance(scheduler, ReduceLROnPlateau):
            scheduler.step()
        elif self._validated_since_plateau_step:
            self._validated_since_plateau_step = False
            scheduler.step(metric)
