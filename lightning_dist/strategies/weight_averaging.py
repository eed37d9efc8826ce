"""Lightning's weight averaging (`WeightAveraging`, `EMAWeightAveraging`, `StochasticWeightAveraging`) under our
strategies.

Each keeps a copy of the model (made in its `setup`, before the strategy shards the model), averages the model's
parameters into it after steps, and writes it as the checkpoint's `state_dict`. As Lightning wrote them, they need
the whole weights on every rank and Lightning's own checkpoint layout, which ld_ddp has. ld_fsdp keeps
`WeightAveraging`'s copy sharded as the model is (strategies/torch/sharded_average.py: Lightning's own copy stopped
the run at its first update, `aten.copy_.default got mixed torch.Tensor and DTensor`). Elsewhere they were measured
stopping or silently wrong (2 CPU ranks, a transformers Llama, `EMAWeightAveraging(decay=0.9)`): under ZeRO-3, whose
module parameters are empty placeholders, the averaged model tested 4.7545 against ddp's 4.7465, without a word;
there, and for StochasticWeightAveraging under ld_fsdp and pipeline stages, the launch stops in one line, before any
rank starts. Under ZeRO-1/2 the checkpoints held the engine's weights and not the average (it was lost), and testing
one stopped (`KeyError: 'state_dict'`): they keep it beside them now (strategies/deepspeed/average.py).

Once a fit has made its average, the callback restores both the average and the model's own weights from every
checkpoint loaded (`on_load_checkpoint`), each from the whole dict on every rank: what a load that reads a checkpoint
otherwise (on rank 0 alone, or around the frozen weights it left out) hands it too (`whole_average_and_current`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_dist.checkpoints.compiled_names import torch_state_dict_name
from lightning_dist.checkpoints.formats import AVERAGING_STATE, CURRENT_MODEL_STATE
from lightning_dist.checkpoints.frozen_weights import may_lack
from lightning_dist.checkpoints.gather import plain_name


def weight_averaging_callbacks(trainer: Any) -> list[Any]:
    """Lightning's `WeightAveraging` callbacks among `trainer`'s (its EMAWeightAveraging is one)."""
    from lightning.pytorch.callbacks import WeightAveraging

    return [callback for callback in getattr(trainer, "callbacks", []) if isinstance(callback, WeightAveraging)]


def saved_with_an_average(checkpoint: dict[str, Any], trainer: Any) -> bool:
    """Whether `checkpoint` holds a weight average as its `state_dict`, and one of `trainer`'s callbacks will restore
    it and the model's own weights (it holds an average: its fit made one)."""
    from lightning_dist._compat.lightning import average_model

    callbacks = weight_averaging_callbacks(trainer)
    return AVERAGING_STATE in checkpoint and any(average_model(callback) is not None for callback in callbacks)


def whole_average_and_current(module: nn.Module, checkpoint: dict[str, Any], from_rank_zero: bool) -> dict[str, Any]:
    """`checkpoint`'s average (`state_dict`) and the model's own weights (`current_model_state`), whole, as the
    callback restores them on every rank: where `from_rank_zero` (rank 0 alone read the checkpoint) broadcast through
    `module` (on every rank: a collective), and each weight the checkpoint left out (frozen, checked) taken from
    `module` as built. `module`'s weights are the model's own afterwards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    left_out = may_lack(checkpoint)
    restored = {}
    for key in ("state_dict", CURRENT_MODEL_STATE):
        if from_rank_zero:  # rank 0's tensors (None elsewhere) into the module, on every rank
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=not left_out)
            saved = {torch_state_dict_name(name): value for name, value in (checkpoint.get(key) or {}).items()}
            set_model_state_dict(module, saved, options=options)  # torch's names: a compiled part's without its prefix
            restored[key] = {plain_name(name): value.detach().clone() for name, value in module.state_dict().items()}
        else:
            built = {plain_name(name): value for name, value in module.state_dict().items()}
            restored[key] = {**{name: built[name] for name in left_out if name in built}, **checkpoint[key]}
    return {**checkpoint, **restored}


def refuse_weight_averaging(trainer: Any, strategy_name: str, why: Callable[[Any], str | None]) -> None:
    """A ValueError where `trainer` has a weight-averaging callback for which `why` (the strategy's reason, given
    the callback) is not None."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging

    for callback in getattr(trainer, "callbacks", []):
        if isinstance(callback, WeightAveraging | StochasticWeightAveraging) and (reason := why(callback)):
            raise ValueError(f"{type(callback).__name__} keeps a copy of the model's weights and saves it as the"
                             f" checkpoint's state_dict, and {strategy_name} {reason}")
