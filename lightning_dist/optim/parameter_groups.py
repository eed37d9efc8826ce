"""Which parameters weight decay applies to: matrices, not biases, norm gains or embeddings (torchtitan and
Hugging Face both exempt the first two; decaying an embedding pulls rare tokens' rows towards zero)."""

from __future__ import annotations

from typing import Any

from torch import nn

# Marks a parameter that stands for an embedding's weight where the embedding itself is not in the module: a
# pipeline's last stage holds the output head tied to the first stage's token embedding (parallel/pipeline_split.py).
# An attribute, not a weak reference: `torch.utils.swap_tensors` (a module's `.to()`) refuses tensors with weakrefs
# and carries attributes over.
_EMBEDDING_COPY = "lightning_dist_embedding_copy"


def decays_as_embedding(parameter: nn.Parameter) -> None:
    """Group `parameter` as an embedding's weight (not decayed), as the weight it is a copy of."""
    setattr(parameter, _EMBEDDING_COPY, True)


def decay_groups(module: nn.Module) -> list[dict[str, Any]]:
    """Two parameter groups for an optimizer: the matrices (decayed with the optimizer's own `weight_decay`) and
    everything else (`weight_decay` 0). A weight shared with an embedding (a tied output head) is not decayed."""
    embedding_weights = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    embedding_weights |= {id(p) for p in module.parameters() if getattr(p, _EMBEDDING_COPY, False)}
    decay, no_decay = [], []
    for parameter in module.parameters():
        if not parameter.requires_grad:
            continue
        if parameter.dim() >= 2 and id(parameter) not in embedding_weights:
            decay.append(parameter)
        else:
            no_decay.append(parameter)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
