"""Learning-rate schedules as multipliers of the optimizer's lr, one optimizer step at a time.

Each is a `torch.optim.lr_scheduler.LambdaLR` (state in checkpoints, stepped by Lightning at `interval: step`), built
from one rule: warm up linearly, hold, then decay to `min_lr_ratio` of the peak over the last `decay_steps`. The
config group `scheduler/` names one of these with `_partial_: true`; the module calls it with its optimizer.

Warmup follows torchtitan: step s of w warms up to (s + 1) / (w + 1) of the peak, so the first step already moves.
"""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

# The share of the run spent warming up when `warmup_steps` is not given (nanoGPT and HF recipes use 1-10%).
DEFAULT_WARMUP_FRACTION = 0.05
DECAY_SHAPES = ("linear", "cosine", "sqrt")


def constant(optimizer: Optimizer, warmup_steps: int = 0) -> LambdaLR:
    """The optimizer's lr throughout, after an optional linear warmup."""
    return LambdaLR(optimizer, WarmupStableDecay(warmup_steps, stable_until=None))


def cosine(
    optimizer: Optimizer, total_steps: int, warmup_steps: int | None = None, min_lr_ratio: float = 0.0
) -> LambdaLR:
    """Linear warmup, then half a cosine down to `min_lr_ratio` of the peak at `total_steps`."""
    return _decaying(optimizer, total_steps, warmup_steps, None, "cosine", min_lr_ratio)


def linear(
    optimizer: Optimizer, total_steps: int, warmup_steps: int | None = None, min_lr_ratio: float = 0.0
) -> LambdaLR:
    """Linear warmup, then a straight line down to `min_lr_ratio` of the peak at `total_steps`."""
    return _decaying(optimizer, total_steps, warmup_steps, None, "linear", min_lr_ratio)


def warmup_stable_decay(
    optimizer: Optimizer,
    total_steps: int,
    warmup_steps: int | None = None,
    decay_fraction: float = 0.2,
    decay: str = "sqrt",
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    """WSD (MiniCPM, DeepSeek): warm up, hold the peak, and decay over the last `decay_fraction` of the run, so a run
    can be extended from any checkpoint taken before the decay."""
    if not 0.0 < decay_fraction <= 1.0:
        raise ValueError(f"model.scheduler.decay_fraction: {decay_fraction} must be in (0, 1]")
    return _decaying(optimizer, total_steps, warmup_steps, round(decay_fraction * total_steps), decay, min_lr_ratio)


def _decaying(
    optimizer: Optimizer,
    total_steps: int,
    warmup_steps: int | None,
    decay_steps: int | None,
    decay: str,
    min_lr_ratio: float,
) -> LambdaLR:
    if not isinstance(total_steps, int) or total_steps <= 0:
        raise ValueError(
            f"model.scheduler.total_steps: {total_steps!r}; a decaying schedule needs the run's length: set "
            "trainer.max_steps"
            " or model.scheduler.total_steps"
        )
    if decay not in DECAY_SHAPES:
        raise ValueError(f"model.scheduler.decay: {decay!r}; choose one of {', '.join(DECAY_SHAPES)}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"model.scheduler.min_lr_ratio: {min_lr_ratio} must be in [0, 1]")
    warmup = round(DEFAULT_WARMUP_FRACTION * total_steps) if warmup_steps is None else warmup_steps
    decay_steps = total_steps - warmup if decay_steps is None else decay_steps
    if warmup < 0 or decay_steps < 0 or warmup + decay_steps > total_steps:
        raise ValueError(
            f"model.scheduler.warmup_steps: {warmup} warmup and {decay_steps} decay steps do not fit in "
            f"total_steps={total_steps}"
        )
    rule = WarmupStableDecay(warmup, stable_until=total_steps - decay_steps, decay_steps=decay_steps, decay=decay,
                             min_lr_ratio=min_lr_ratio)
    return LambdaLR(optimizer, rule)


class WarmupStableDecay:
    """The multiplier at optimizer step `step` (0-based). A class rather than a closure so that LambdaLR's state dict
    (which pickles callables that are objects, not functions) and our plain-data checkpoints stay simple: LambdaLR
    saves only `__dict__` of callable objects, here plain numbers and a string."""

    def __init__(self, warmup_steps: int, stable_until: int | None, decay_steps: int = 0, decay: str = "linear",
                 min_lr_ratio: float = 0.0) -> None:
        self.warmup_steps = warmup_steps
        self.stable_until = stable_until
        self.decay_steps = decay_steps
        self.decay = decay
        self.min_lr_ratio = min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.stable_until is None or step < self.stable_until:
            return 1.0
        progress = min(1.0, (step - self.stable_until) / max(1, self.decay_steps))
        if self.decay == "cosine":
            remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
        elif self.decay == "sqrt":
            remaining = 1.0 - math.sqrt(progress)
        else:
            remaining = 1.0 - progress
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * remaining
