"""A PEFT model's adapters written whole, in PEFT's own format, from a run under any strategy.

Under FSDP each rank holds a shard of every adapter, under ZeRO-3 a partition: writing what a rank holds loses the
rest (accelerate #4206: (N-1)/N of each adapter gone at resume) or writes nothing (DeepSpeed #7900: an empty
`adapter_model.safetensors`). Here the adapters alone are gathered from every rank, and global rank 0 has PEFT
write them (`PeftModel.save_pretrained` with the gathered state dict), so `PeftModel.from_pretrained` loads them.

PEFT picks an adapter's entries by the names of the tuner layers the model holds (`get_peft_model_state_dict`), which
activation checkpointing's wrapper is part of, and under pipeline stages a stage's own: each rank has PEFT pick its
entries named as its model names them, and the file holds every stage's under their plain names.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lightning_dist._compat.peft import adapter_names, is_tuner_layer
from lightning_dist.checkpoints.gather import every_stage, gather_full_state_dict, plain_name


def adapter_parameter_names(model: nn.Module) -> set[str]:
    """The names of the parameters of every PEFT adapter in `model` (its tuner layers' adapter modules)."""
    names = set()
    for module_name, module in model.named_modules():
        if is_tuner_layer(module):
            for attribute in adapter_names(module):
                held = getattr(module, attribute, None)
                if isinstance(held, nn.Module):
                    prefix = f"{module_name}.{attribute}".lstrip(".")
                    names |= {plain_name(f"{prefix}.{name}") for name, _ in held.named_parameters()}
    return names


def save_adapters(model: nn.Module, folder: str | Path) -> Path:
    """Write the adapters of PEFT model `model` to `folder` (`adapter_config.json`, `adapter_model.safetensors`),
    gathered from every rank: a collective, to call on every rank (after `trainer.fit`, or in a hook)."""
    names = adapter_parameter_names(model)
    if not names:
        raise ValueError(f"save_adapters: {type(model).__name__} has no PEFT adapters (get_peft_model adds them)")
    adapters = gather_full_state_dict(model, names)
    entries = {adapter: every_stage(model, _picked_by_peft(model, adapters, adapter, names))
               for adapter in model.peft_config}  # type: ignore[union-attr]
    if not dist.is_initialized() or dist.get_rank() == 0:
        from peft.utils import SAFETENSORS_WEIGHTS_NAME
        from safetensors.torch import save_file

        model.save_pretrained(str(folder), state_dict=adapters, is_main_process=True)  # type: ignore[operator]
        for adapter, written in entries.items():  # PEFT's own pick is replaced: see _picked_by_peft
            directory = Path(folder) if adapter == "default" else Path(folder) / adapter  # as PEFT places them
            save_file({name: value.contiguous() for name, value in written.items()},
                      directory / SAFETENSORS_WEIGHTS_NAME, metadata={"format": "pt"})
    if dist.is_initialized():
        dist.barrier()
    return Path(folder)


def _picked_by_peft(model: nn.Module, adapters: dict[str, torch.Tensor], adapter: str, names: set[str]
                    ) -> dict[str, torch.Tensor]:
    """`adapter`'s entries of `adapters` (plain names) as PEFT names them in its file. PEFT picks them by the names
    of the tuner layers `model` holds (`get_peft_model_state_dict`): activation checkpointing's wrapper is in those,
    not in a state dict's, and PEFT wrote an empty file (every block checkpointed) or one without some layers'
    adapters; a pipeline stage holds its own layers only. So PEFT picks from the entries named as the model names
    them, which are then written under the plain names; each of the adapter's weights must be among them (PEFT
    #3584: another adapter named as a module, `mlp`, drops that module's entries, without a word)."""
    from peft import get_peft_model_state_dict

    as_the_model_names_them = {name: adapters[plain_name(name)] for name, _ in model.named_parameters()
                               if plain_name(name) in adapters}
    picked = {plain_name(name): value for name, value in
              get_peft_model_state_dict(model, state_dict=as_the_model_names_them, adapter_name=adapter).items()}
    held = sorted(name for name in names if f".{adapter}." in f".{name}.")
    if missing := [name for name in held if _without_adapter(name, adapter) not in picked]:
        raise RuntimeError(f"save_adapters: PEFT picked {len(held) - len(missing)} of the {len(held)} weights of"
                           f" adapter {adapter!r} ({missing[0]} not among them): nothing written")
    return picked


def _without_adapter(name: str, adapter: str) -> str:
    """`name` as PEFT's file names it: without the adapter's segment, the last one that is its name."""
    parts = name.split(".")
    index = len(parts) - 1 - parts[::-1].index(adapter)
    return ".".join(parts[:index] + parts[index + 1:])
