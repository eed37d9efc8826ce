"""transformers' pipeline plans, as its models declare them: the base model's split in its config
(`base_model_pp_plan`, public), and the modules a task model runs after the base model (`_pp_plan`, a class attribute
of its causal LMs: `{"lm_head": (["hidden_states"], ["logits"])}`), read here and nowhere else. And a model's loss:
the function its `loss_function` property gives (one the user set on the model, else `LOSS_MAPPING[loss_type]`, the
causal LM's where the class name names no loss type), replaced for a step through the property's own setter.
Checked on transformers 5.24. transformers is imported only where the user's model is one of its models."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning_dist._compat.fenced import Fenced

FENCED = [Fenced("transformers.loss.loss_utils", "LOSS_MAPPING"),
          Fenced("transformers.modeling_utils", "PreTrainedModel.loss_function")]

CAUSAL_LM = "ForCausalLM"  # the loss type that shifts the labels by one token itself


def head_plan(model: Any) -> list[str]:
    """The modules `model` runs after its base model, in order (its `_pp_plan`); [] for a base model."""
    return list(getattr(model, "_pp_plan", None) or {})


def transformers_models(module: Any) -> list[Any]:
    """The transformers models in `module` (each has a `loss_function`, which those given `labels=` call)."""
    return [m for m in module.modules() if isinstance(getattr(type(m), "loss_function", None), property)]


def loss_kind(model: Any) -> str:
    """What `model.loss_function` computes: its loss type ("ForCausalLM", ...), or the name of a function the user
    set on the model."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    own = model.__dict__.get("_loss_function")
    if own is not None:
        return next((kind for kind, function in LOSS_MAPPING.items() if function is own), getattr(own, "__name__", "?"))
    return model.loss_type if model.loss_type in LOSS_MAPPING else CAUSAL_LM


@contextmanager
def loss_function_replaced(model: Any, make: Callable[[Callable[..., Any], str], Callable[..., Any]]) -> Iterator[None]:
    """`model.loss_function` is `make(the function in effect, its loss_kind)` inside; as it was after."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    own = model.__dict__.get("_loss_function")  # one the user set on the model, kept
    kind = loss_kind(model)
    in_effect: Callable[..., Any] = own or LOSS_MAPPING[kind]
    model.loss_function = make(in_effect, kind)
    try:
        yield
    finally:
        if own is None:
            del model._loss_function
        else:
            model._loss_function = own
