"""Lightning's weight averaging (`WeightAveraging`, `EMAWeightAveraging`, `StochasticWeightAveraging`) under our
strategies.

Each keeps a copy of the model (made in its `setup`, before the strategy shards the model), averages the model's
parameters into it after steps, and writes it as the checkpoint's `state_dict`. As Lightning wrote them, they need
the whole weights on every rank and Lightning's own checkpoint layout, which ld_ddp has. ld_fsdp keeps
`WeightAveraging`'s copy sharded as the model is (strategies/torch/sharded_average.py). Elsewhere they were measured
stopping or silently wrong (2 CPU ranks, a transformers Llama, `EMAWeightAveraging(decay=0.9)`): under ld_fsdp every
update stopped the run (`aten.copy_.default got mixed torch.Tensor and DTensor`); under ZeRO-3, whose module
parameters are empty placeholders, the averaged model tested 4.7545 against ddp's 4.7465, without a word; under
ZeRO-1/2 the checkpoints held the engine's weights and not the average (it was lost), and testing one stopped
(`KeyError: 'state_dict'`). There the launch stops in one line, before any rank starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def refuse_weight_averaging(trainer: Any, strategy_name: str, why: Callable[[Any], str | None]) -> None:
    """A ValueError where `trainer` has a weight-averaging callback for which `why` (the strategy's reason, given
    the callback) is not None."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging

    for callback in getattr(trainer, "callbacks", []):
        if isinstance(callback, WeightAveraging | StochasticWeightAveraging) and (reason := why(callback)):
            raise ValueError(f"{type(callback).__name__} keeps a copy of the model's weights and saves it as the"
                             f" checkpoint's state_dict, and {strategy_name} {reason}")
