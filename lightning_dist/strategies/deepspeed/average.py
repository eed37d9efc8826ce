"""Lightning's weight averaging (`EMAWeightAveraging`, `WeightAveraging`) under ZeRO-1 and ZeRO-2.

The callback's copy of the model, its updates and its swaps for validation work as they are: below ZeRO-3 every rank
holds the module's weights whole. Its checkpoints did not: the callback puts the average in the checkpoint's
`state_dict` and the model's own weights in `current_model_state`, and Lightning's DeepSpeed strategy leaves
`state_dict` out of what the engine saves (the engine saves its module): the average was lost, and testing the
checkpoint stopped in the callback (`KeyError: 'state_dict'`). Here the average is saved in the engine's client state
under its own key (the model's weights are the engine's module: not saved twice), and a load gives back Lightning's
layout: `state_dict` the average, `current_model_state` the weights the engine loaded. A test, validation or
prediction from the checkpoint runs the average, as under ddp; a fit hands both to the callback, which restores them.
A checkpoint read by another strategy (consolidated, checkpoints/consolidate.py) has the same layout.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_dist._compat.lightning import attached_trainer
from lightning_dist.checkpoints.formats import AVERAGE_STATE_DICT, AVERAGING_STATE, CURRENT_MODEL_STATE
from lightning_dist.checkpoints.gather import plain_name


def average_into_client_state(checkpoint: dict[str, Any], left_out: set[str]) -> dict[str, Any]:
    """`checkpoint` as the engine is to save it: where it holds an average, the average under its own key, without
    the weights the save leaves out (`left_out`: frozen, under exclude_frozen_parameters), and without the model's
    own weights, which are the engine's module."""
    if AVERAGING_STATE not in checkpoint:
        return checkpoint
    average = {name: value for name, value in checkpoint["state_dict"].items() if plain_name(name) not in left_out}
    return {**{key: value for key, value in checkpoint.items() if key != CURRENT_MODEL_STATE},
            AVERAGE_STATE_DICT: average}


def average_out_of_client_state(module: nn.Module, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """After the engine loaded a checkpoint saved with an average: Lightning's layout again (`state_dict` the
    average, each weight it left out the module's; `current_model_state` the module's weights as loaded), and, where
    the module is not being fitted, the average in the module (what a test of a ddp checkpoint runs). A fit leaves
    the module's weights to the callback, which restores both."""
    if AVERAGE_STATE_DICT not in checkpoint:
        return checkpoint
    current = {plain_name(name): value.detach().clone() for name, value in module.state_dict().items()}
    frozen = {plain_name(name) for name, parameter in module.named_parameters() if not parameter.requires_grad}
    average = {**{name: current[name] for name in frozen if name in current}, **checkpoint[AVERAGE_STATE_DICT]}
    restored = {**{key: value for key, value in checkpoint.items() if key != AVERAGE_STATE_DICT},
                "state_dict": average, CURRENT_MODEL_STATE: current}
    trainer = attached_trainer(module)
    if trainer is None or trainer.state.fn != TrainerFn.FITTING:
        module.load_state_dict(average)
    return restored
