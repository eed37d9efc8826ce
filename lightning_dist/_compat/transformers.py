"""transformers' pipeline plans, as its models declare them: the base model's split in its config
(`base_model_pp_plan`, public), and the modules a task model runs after the base model (`_pp_plan`, a class attribute
of its causal LMs: `{"lm_head": (["hidden_states"], ["logits"])}`), read here and nowhere else. transformers itself is
not imported: these are the model's own attributes."""

from __future__ import annotations

from typing import Any


def head_plan(model: Any) -> list[str]:
    """The modules `model` runs after its base model, in order (its `_pp_plan`); [] for a base model."""
    return list(getattr(model, "_pp_plan", None) or {})
