"""A transformers model's pipeline stages, run by the model's own forward.

A transformers decoder (`LlamaModel`, `Qwen2Model`, ...) declares how it splits in its config's
`base_model_pp_plan`: the embedding, then the layers, then the final norm; the causal LM around it adds its head
(its pipeline plan: `lm_head`; _compat/transformers.py). Its layers need more than the hidden states (rotary
`position_embeddings`, the causal mask, positions), which the model's forward makes from the sequence: so each stage
runs that forward itself, over its own layers only, entering with `input_ids` on the first stage and with the
received hidden states as `inputs_embeds` after it. The norm runs on the last stage only; the head after it, by the
causal LM's own forward (its base model answered by the stage's output), so that what the forward does after the
head (a soft cap, a logit scale) is done too.
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

from lightning_dist._compat.transformers import head_plan, transformers_models

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
        if view.is_last and self.outer_after:
            return _own_logits(trunk, self.base, output)
        return output[0]  # last_hidden_state

    @staticmethod
    def answer(trunk: Any, output: Any, args: tuple, kwargs: dict) -> Any:
        return answer(trunk, output, args, kwargs)


def router_loss_refusal(model: nn.Module, size: int) -> str | None:
    """Why pipeline stages cannot train `model`: a transformers mixture of experts asked for its routers'
    load-balancing loss, which it makes from every layer's router logits at once (each stage holds some of the
    layers: every rank stopped in the first step); None where none asks."""
    for found in transformers_models(model):
        if getattr(found.config, "output_router_logits", False):
            return (f"strategy.pipeline_parallel_size={size}: {type(found).__name__} adds its routers' load-balancing"
                    " loss (model.config.output_router_logits=true), made from every layer's routers at once, which"
                    " pipeline stages hold apart; set it false to train without it, or split the experts instead"
                    " (strategy=fsdp strategy.expert_parallel_size=2)")
    return None


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


def _own_logits(trunk: nn.Module, base: str, output: Any) -> Any:
    """The logits the causal LM `trunk`'s own forward makes of its base model's `output`: its head, and what its
    forward does after it (Gemma 2's and 3's final soft cap, Cohere's logit scale, Granite's logit scaling), which a
    stage that ran the head alone left out (Gemma 2 trained 1.7e-4 off one rank's loss after 8 steps, silently).
    The base model (`base`, its path) is stood in for by one that answers with `output`."""
    stand_in = _Answers(output)
    with _children_swapped(trunk, {base: stand_in}):
        logits = type(trunk).forward(trunk, inputs_embeds=output[0], use_cache=False).logits
    if stand_in.calls != 1:
        raise RuntimeError(f"pipeline parallelism: {type(trunk).__name__}'s forward called its base model"
                           f" {stand_in.calls} times, not once: its last stage cannot make its logits")
    return logits


class _Answers(nn.Module):
    """Answers every call with `output`, counting them."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output, self.calls = output, 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.output


@contextmanager
def _children_swapped(module: nn.Module, children: dict[str, nn.Module]) -> Iterator[None]:
    """`module`'s submodules at the (dotted) paths of `children` replaced by them, within the block."""
    saved = {path: module.get_submodule(path) for path in children}

    def put(path: str, child: nn.Module) -> None:
        parent, _, name = path.rpartition(".")
        setattr(module.get_submodule(parent), name, child)

    for path, child in children.items():
        put(path, child)
    try:
        yield
    finally:
        for path, child in saved.items():
            put(path, child)
