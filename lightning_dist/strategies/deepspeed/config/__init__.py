"""Bring-your-own DeepSpeed config: Hugging Face-style JSON with "auto" values, filled from the Trainer, the
LightningModule and the data, with every contradiction reported before any rank starts."""

from lightning_dist.strategies.deepspeed.config.facts import UNKNOWN, OptimizerFacts, TrainingFacts, training_facts
from lightning_dist.strategies.deepspeed.config.load import load_user_config, write_effective_config
from lightning_dist.strategies.deepspeed.config.resolve import (
    FILLED_KEYS,
    DeepSpeedConfigError,
    Resolution,
    ZeroOptions,
    resolve,
    resolve_config,
)

__all__ = [
    "FILLED_KEYS",
    "UNKNOWN",
    "DeepSpeedConfigError",
    "OptimizerFacts",
    "Resolution",
    "TrainingFacts",
    "ZeroOptions",
    "load_user_config",
    "resolve",
    "resolve_config",
    "training_facts",
    "write_effective_config",
]
