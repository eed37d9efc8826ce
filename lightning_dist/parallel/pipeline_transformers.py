"""A transformers model's pipeline stages, run by the model's own forward.

A transformers decoder (`LlamaModel`, `Qwen2Model`, ...) declares how it splits in its config's
`base_model_pp_plan`: the embedding, then the layers, then the final norm; the causal LM around it adds its head
(its pipeline plan: `lm_head`; _compat/transformers.py). Its layers need more than the hidden states (rotary
`position_embeddings`, the causal mask, positions), which the model's forward makes from the sequence: so each stage
runs that forward itself, over its own layers only, entering with `input_ids` on the first stage and with the
received hidden states as `inputs_embeds` after it. The norm runs on the last stage only, and the head after it.
Positions and the causal mask are made again on every stage from the sequence's length, as the whole model makes
them, so a stage needs no more than the hidden states from the one before.

On the last stage the step's call of the model is answered as the model answers it: its logits in a
`CausalLMOutputWithPast`, and its loss when the step passes `labels` (the model's own `loss_function`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from lightning_dist._compat.transformers import head_plan

# What a stage after the first cannot receive: it gets the hidden states only.
_FIRST_STAGE_ONLY = ("attention_mask", "position_ids")


class TransformersStage:
    """Runs one stage of a transformers model (the trunk), as `StageView.forward`."""

    def __init__(self, trunk: Any, after: dict[str, nn.Module]) -> None:
        """`trunk`: pipeline_split's Trunk (where the stack is); `after`: the modules after the blocks, by path."""
        self.base, _, self.stack = trunk.stack.rpartition(".")
        inner = f"{self.base}." if self.base else ""
        # After the blocks: the base model's own modules (its norm), skipped by stages before the last; and the
        # modules around the base model (the head), which the last stage applies to the base model's output.
        own = [path.removeprefix(inner) for path in after if path.startswith(inner)]
        self.base_after = [name for name in own if "." not in name]
        self.outer_after = [path for path in after if not path.startswith(inner)]
        self._layers: dict[int, nn.ModuleList] = {}

    def __call__(self, view: Any, inputs: tuple, kwargs: dict) -> Any:
        """Stage `view`'s forward (a pipeline_split.StageView)."""
        trunk = view.trunk
        base = trunk.get_submodule(self.base)
        layers = self._layers.setdefault(view.stage, nn.ModuleList(view.blocks.values()))
        swapped: dict[str, nn.Module] = {self.stack: layers}
        if not view.is_last:
            swapped.update({name: nn.Identity() for name in self.base_after})
        with _children_swapped(base, swapped):
            if view.is_first:
                output = base(**_first_stage_inputs(trunk, inputs, kwargs), use_cache=False)
            else:
                output = base(inputs_embeds=inputs[0], use_cache=False)
        hidden = output[0]  # last_hidden_state
        if view.is_last:
            for path in _head_order(trunk, self.outer_after):
                hidden = trunk.get_submodule(path)(hidden)
        return hidden

    @staticmethod
    def answer(trunk: Any, output: Any, args: tuple, kwargs: dict) -> Any:
        return answer(trunk, output, args, kwargs)


def answer(trunk: Any, output: Any, args: tuple, kwargs: dict) -> Any:
    """What `trunk(*args, **kwargs)` returns, given the last stage's `output`: a causal LM's logits (and loss,
    when called with `labels`), or a base model's last hidden states."""
    from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

    if not head_plan(trunk):
        return BaseModelOutputWithPast(last_hidden_state=output)
    labels = _arguments(trunk, args, kwargs).get("labels")
    loss = None
    if labels is not None:
        loss = trunk.loss_function(logits=output, labels=labels, vocab_size=trunk.config.vocab_size)
    return CausalLMOutputWithPast(loss=loss, logits=output)


def _first_stage_inputs(trunk: nn.Module, inputs: tuple, kwargs: dict) -> dict[str, Any]:
    given = _arguments(trunk, inputs, kwargs)
    unreachable = [name for name in _FIRST_STAGE_ONLY if given.get(name) is not None]
    if unreachable:
        raise ValueError(f"pipeline parallelism: {type(trunk).__name__} is called with {', '.join(unreachable)},"
                         " which only its first stage would see (each stage makes positions and the causal mask"
                         " from the sequence); call it with input_ids only, in windows without padding")
    return {name: given[name] for name in ("input_ids", "inputs_embeds") if given.get(name) is not None}


def _arguments(trunk: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by name, as the model's class's forward takes them: the instance's `forward` may be a
    stand-in while a stage answers the call (pipeline.py), whose `(*args, **kwargs)` would name none of them."""
    signature = inspect.signature(type(trunk).forward)
    named = dict(list(signature.bind_partial(trunk, *args, **kwargs).arguments.items())[1:])
    for parameter in signature.parameters.values():  # a forward's **kwargs (transformers' TransformersKwargs)
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            named = {**named.pop(parameter.name, {}), **named}
    return named


def _head_order(trunk: nn.Module, paths: list[str]) -> list[str]:
    """The modules around the base model in the order the model's `_pp_plan` runs them."""
    plan = head_plan(trunk)
    return sorted(paths, key=lambda path: plan.index(path) if path in plan else len(plan))


@contextmanager
def _children_swapped(module: nn.Module, children: dict[str, nn.Module]) -> Iterator[None]:
    saved = {name: module.get_submodule(name) for name in children}
    for name, child in children.items():
        setattr(module, name, child)
    try:
        yield
    finally:
        for name, child in saved.items():
            setattr(module, name, child)
