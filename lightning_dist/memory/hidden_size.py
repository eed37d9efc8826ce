"""A model's hidden size, where its hyper-parameters (or its Hugging Face `config`) name one: what DeepSpeed's
bucket-size "auto"s follow, and what the planner and the FLOP count read. No torch here."""

from __future__ import annotations

from typing import Any

# Model hyper-parameter names that give the hidden size.
HIDDEN_SIZE_NAMES = ("hidden_size", "n_embd", "d_model", "embed_dim")


def hidden_size_of(model: Any) -> int | None:
    """The hidden size a model's hyper-parameters (or its Hugging Face `config`) name, if any."""
    return _hidden_size(model, getattr(model, "hparams", None) or {})


def _hidden_size(model: Any, hparams: Any) -> int | None:
    sources = [hparams, getattr(getattr(model, "config", None), "__dict__", {})]
    for source in sources:
        for name in HIDDEN_SIZE_NAMES:
            if isinstance(source.get(name), int):
                return source[name]
    return None
