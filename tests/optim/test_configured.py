"""ConfiguredOptimizers: the factories build the optimizer and scheduler; a plateau scheduler steps once per
validation, on the monitored metric, however often Lightning asks."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import torch

from lightning_dist.optim import ConfiguredOptimizers, decay_groups
from lightning_dist.optim.schedules import cosine


class Module(ConfiguredOptimizers, torch.nn.Module):
    def __init__(self, optimizer=None, scheduler=None) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(8, 4)
        self.linear = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.trainer = SimpleNamespace(sanity_checking=False)


def test_matrices_decay_and_embeddings_biases_and_norms_do_not():
    module = Module()
    decay, no_decay = decay_groups(module)
    assert decay["params"] == [module.linear.weight] and "weight_decay" not in decay
    assert no_decay == {"params": [module.embedding.weight, module.linear.bias, module.norm.weight, module.norm.bias],
                        "weight_decay": 0.0}


def test_without_factories_the_default_is_fused_adamw():
    optimizer = Module().configure_optimizers()
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"] is True
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.01, 0.0]


def test_a_schedule_is_stepped_every_optimizer_step():
    module = Module(partial(torch.optim.SGD, lr=1.0), partial(cosine, total_steps=10, warmup_steps=0))
    config = module.configure_optimizers()
    assert config["lr_scheduler"]["interval"] == "step"
    scheduler = config["lr_scheduler"]["scheduler"]
    config["optimizer"].step()
    module.lr_scheduler_step(scheduler, None)
    assert scheduler.last_epoch == 1


def test_a_plateau_scheduler_steps_once_per_validation_on_the_metric():
    plateau = partial(torch.optim.lr_scheduler.ReduceLROnPlateau, mode="min", factor=0.5, patience=0)
    module = Module(partial(torch.optim.SGD, lr=1.0), plateau)
    config = module.configure_optimizers()
    assert {k: config["lr_scheduler"][k] for k in ("interval", "monitor", "strict")} == {
        "interval": "step", "monitor": "val_loss", "strict": False}
    scheduler, optimizer = config["lr_scheduler"]["scheduler"], config["optimizer"]
    module.lr_scheduler_step(scheduler, torch.tensor(3.0))  # no validation yet: nothing
    module.on_validation_end()
    for _ in range(5):  # asked after every step; acts on the first request after the validation only
        module.lr_scheduler_step(scheduler, torch.tensor(3.0))
    module.on_validation_end()
    module.lr_scheduler_step(scheduler, torch.tensor(3.0))  # no improvement, patience 0: halved once
    assert optimizer.param_groups[0]["lr"] == 0.5
    module.trainer.sanity_checking = True
    module.on_validation_end()  # the sanity check is not a validation of training
    module.lr_scheduler_step(scheduler, torch.tensor(3.0))
    assert optimizer.param_groups[0]["lr"] == 0.5
