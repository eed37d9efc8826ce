"""Gradient clipping under DeepSpeed: asked of the engine, which clips inside its own step.

Lightning's DeepSpeed precision ignores `LightningModule.clip_gradients`, and leaves clipping to the config's
gradient_clipping (set from `Trainer(gradient_clip_val=...)`). So a manual-optimization step's
`self.clip_gradients(opt, 1.0)`, or a `configure_gradient_clipping` hook that clips at another norm, changed nothing
and said nothing. Here each call sets the norm the engine clips its next step to, and after that step it clips by
the run's configured norm again: the value a ZeRO-1/2 optimizer would otherwise take from a checkpoint it resumes from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.utilities import GradClipAlgorithmType
from typing_extensions import override

from lightning_dist._compat.deepspeed import clip_steps_at
from lightning_dist.strategies.deepspeed.precision import FrozenWeightsAsLoaded

# Lightning's warning that an overridden configure_gradient_clipping clips nothing under DeepSpeed: here it does.
HOOK_IGNORED_WARNING = "Since DeepSpeed handles gradient clipping internally"


class ClippingInTheEngine(FrozenWeightsAsLoaded):
    """DeepSpeed's precision for a training engine, passing `clip_gradients` on to it."""

    def __init__(self, precision: Any, engine: Any) -> None:
        super().__init__(precision)
        self.engine = engine
        self.configured_norm = engine.gradient_clipping()  # the config's, before any call changes what the engine uses
        self.asked = False

    @override
    def clip_gradients(self, optimizer: Any, clip_val: int | float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        if clip_val <= 0:  # what Lightning's default hook passes where nothing is set: the config's norm stays
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise ValueError(
                f"clip_gradients(gradient_clip_val={clip_val}, gradient_clip_algorithm='value'): DeepSpeed clips by "
                "the global norm only; pass gradient_clip_algorithm='norm'"
            )
        clip_steps_at(self.engine, clip_val)
        self.asked = True

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:  # type: ignore[override]
        try:
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        finally:
            if self.asked:  # one step's request: the next step clips as configured unless asked again
                self.use_configured_norm()

    def use_configured_norm(self) -> None:
        clip_steps_at(self.engine, self.configured_norm)
        self.asked = False
