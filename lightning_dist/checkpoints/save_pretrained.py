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
