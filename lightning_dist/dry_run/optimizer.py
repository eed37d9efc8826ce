"""The optimizer a dry run steps: the module's own, so that its states are the ones the run would keep."""

from __future__ import annotations

import torch
from torch import nn


def configured_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer the module's `configure_optimizers` makes (the first, if several), else AdamW."""
    configure = getattr(model, "configure_optimizers", None)
    configured = configure() if callable(configure) else None
    configured = configured[0] if isinstance(configured, (list, tuple)) else configured
    configured = configured.get("optimizer") if isinstance(configured, dict) else configured
    return configured if isinstance(configured, torch.optim.Optimizer) else torch.optim.AdamW(model.parameters())
