"""A Hugging Face model that starts from a local `save_pretrained` folder, loaded shard by shard.

    self.model = lightning_dist.from_pretrained(folder)   # in configure_model, or in __init__

Under a strategy that builds the model without weights (fsdp and its variants, ZeRO-3, pipeline and tensor
parallelism, in `configure_model` or `trainer.init_module()`), the model is built from the folder's config on the
meta device and, once the strategy has sharded it, each rank reads the folder tensor by tensor and keeps its
shard of each (parallel/pretrained_weights.py): no rank ever holds the whole model. Elsewhere (ddp, ZeRO-1/2, a
plain script) it is built the same way and every weight is read at once. Either way the weights are in the run's
precision (the default dtype: float32, or bf16 under `bf16-true`), not the folder's, unless `dtype="auto"` asks for
the folder's; a folder that is not the model's is refused in one line naming the first mismatches before any step.

transformers' own `from_pretrained` works too, under every strategy, but holds the whole model on every rank
(converted to the run's dtype) until the strategy shards it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_dist.parallel.pretrained_weights import PretrainedFolder
from lightning_dist.parallel.sharded_init import (
    building_on_meta,
    give_memory,
    initialize_parameters,
    parameters_on_meta,
)


def from_pretrained(folder: str | Path, auto_class: Any = None, key: str = "pretrained",
                    dtype: torch.dtype | str | None = None, **config: Any) -> nn.Module:
    """The transformers model saved in `folder` (`auto_class`: unset, AutoModelForCausalLM, or
    AutoModelForSeq2SeqLM for an encoder-decoder), with its weights, or with them to come where the strategy
    initialises its shards. `dtype`: the run's (the default dtype) unless given; "auto" is the folder's, as
    transformers' `from_pretrained(dtype="auto")` reads it (a LoRA base kept in the bf16 it was saved in). `config`:
    values that replace the folder config's (e.g. `attn_implementation`). `key`: how errors name the folder
    (`model.pretrained` under train.py)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    weights = PretrainedFolder(folder, key)
    hf_config = AutoConfig.from_pretrained(folder, **config)
    if weights.packed:  # read unpacked: the model holds, and a save_pretrained of it writes, plain weights
        del hf_config.quantization_config
    if auto_class is None:
        auto_class = AutoModelForSeq2SeqLM if hf_config.is_encoder_decoder else AutoModelForCausalLM
    # Built for a plan (under the meta device) or for a strategy that initialises shards: the weights stay in the
    # folder, attached, read only where shards are initialised (planning read the whole model before).
    deferred = building_on_meta() or torch.empty(()).is_meta
    if dtype == "auto":  # transformers 5 reads the config's dtype (or torch_dtype) into `dtype`, 4 into torch_dtype
        saved = hf_config.dtype if hasattr(hf_config, "dtype") else getattr(hf_config, "torch_dtype", None)
        dtype = getattr(torch, saved, None) if isinstance(saved, str) else saved
    if not isinstance(dtype, torch.dtype):
        dtype = torch.get_default_dtype()
    with parameters_on_meta():  # no weights drawn here: they are read from the folder
        model = auto_class.from_config(hf_config, dtype=dtype)
    weights.attach(model)
    if not deferred:
        initialize_parameters(model, give_memory, params=[p for p in model.parameters() if p.is_meta])
        del model.pretrained_weights
    return model
