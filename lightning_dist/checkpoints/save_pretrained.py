"""A transformers model written whole as a `save_pretrained` folder, from a run under any strategy.

After `trainer.fit` the model is still as the strategy holds it: sharded (FSDP2 DTensors), partitioned (ZeRO-3) or
split into pipeline stages. transformers' own `model.save_pretrained` on one rank then fails (torch: "Attempted to
access the data pointer on an invalid python storage") or writes that rank's part. Here the weights are gathered
from every rank, and global rank 0 has transformers write them, so `AutoModel*.from_pretrained` loads the model
trained. A PEFT model's adapters are written as `save_adapters` writes them, which is what PEFT's own
`save_pretrained` writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_dist.checkpoints.adapters import adapter_parameter_names, save_adapters
from lightning_dist.checkpoints.gather import gather_full_state_dict
from lightning_dist.parallel.devices import gather_objects


def save_pretrained(model: nn.Module, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write transformers model `model` to `folder` with its `save_pretrained`, gathered from every rank: a collective,
    to call on every rank (after `trainer.fit`, or in a hook). `dtype`: the floating weights written in it (the
    strategy trains them in fp32 under 32-true and the mixed precisions; `torch.bfloat16` halves the folder). A folder
    that holds anything already is refused: nothing there is overwritten."""
    folder = Path(folder)
    if not hasattr(model, "save_pretrained") or not hasattr(model, "config"):
        raise TypeError(f"save_pretrained: {type(model).__name__} is not a transformers model; pass the one your"
                        " module holds (e.g. `self.model`)")
    if adapter_parameter_names(model):  # PEFT's save_pretrained writes the adapters alone
        return save_adapters(model, folder)
    main = not dist.is_initialized() or dist.get_rank() == 0
    taken = main and folder.exists() and (not folder.is_dir() or any(folder.iterdir()))
    if gather_objects(taken)[0]:  # rank 0's answer on every rank: all raise together, or all gather
        raise FileExistsError(f"save_pretrained: {folder} is not empty; pass a new folder (nothing there is"
                              " overwritten)")
    weights = gather_full_state_dict(model)
    if main:
        if dtype is not None:
            weights = {name: t.to(dtype) if t.is_floating_point() else t for name, t in weights.items()}
        model.save_pretrained(str(folder), state_dict=weights, is_main_process=True)  # type: ignore[operator]
        if dtype is not None:  # transformers records the dtype the model holds, which `from_pretrained` loads in
            _record_dtype(folder / "config.json", dtype)
    if dist.is_initialized():
        dist.barrier()
    return folder


def _record_dtype(config_file: Path, dtype: torch.dtype) -> None:
    config = json.loads(config_file.read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def refuse_own_save_pretrained(module: nn.Module, strategy_name: str) -> None:
    """transformers' and PEFT's own `save_pretrained` on each model inside `module`, whose weights `strategy_name`
    holds sharded, stops in one line naming this module's `save_pretrained` (it stopped deep in safetensors on the
    rank that called it: "Attempted to access the data pointer on an invalid python storage"). A call given the
    weights (`state_dict=`, as `save_pretrained` and `save_adapters` here give them) goes through."""
    for model in module.modules():
        original = getattr(model, "save_pretrained", None)
        if not callable(original) or getattr(original, "refuses_sharded_weights", False):
            continue
        if not hasattr(model, "config") and not hasattr(model, "peft_config"):
            continue  # not a transformers or PEFT model

        def save_pretrained(*args: Any, _original: Any = original, _model: nn.Module = model, **kwargs: Any) -> Any:
            if "state_dict" in kwargs:
                return _original(*args, **kwargs)
            raise RuntimeError(f"{type(_model).__name__}.save_pretrained: {strategy_name} holds the weights sharded"
                               " over the ranks; call lightning_dist.save_pretrained(model, folder) on every rank,"
                               " which gathers them (dtype=torch.bfloat16 writes them in bf16)")

        save_pretrained.refuses_sharded_weights = True  # type: ignore[attr-defined]
        vars(model)["save_pretrained"] = save_pretrained  # an instance attribute: it comes before the class's method
        if model.save_pretrained is not save_pretrained:
            raise RuntimeError(f"{type(model).__name__}.save_pretrained could not be intercepted: its own would write"
                               " this rank's part of the weights; this transformers is not one lightning-dist"
                               " supports")
