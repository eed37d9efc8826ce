"""A PEFT model's adapters written whole, in PEFT's own format, from a run under any strategy.

Under FSDP each rank holds a shard of every adapter, under ZeRO-3 a partition: writing what a rank holds loses the
rest (accelerate #4206: (N-1)/N of each adapter gone at resume) or writes nothing (DeepSpeed #7900: an empty
`adapter_model.safetensors`). Here the adapters alone are gathered from every rank, and global rank 0 has PEFT
write them (`PeftModel.save_pretrained` with the gathered state dict), so `PeftModel.from_pretrained` loads them.

Under pipeline stages PEFT picks an adapter's entries by the tuner layers the model holds, a stage's own: each stage
has PEFT name its entries (`get_peft_model_state_dict`), and the file holds every stage's.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
from torch import nn

from lightning_dist._compat.peft import adapter_names, is_tuner_layer
from lightning_dist.checkpoints.gather import every_stage, gather_full_state_dict, plain_name
from lightning_dist.parallel.pipeline_split import stage_group


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
    by_stage = _named_by_each_stage(model, adapters) if stage_group(model) is not None else {}
    main = not dist.is_initialized() or dist.get_rank() == 0
    if main:
        model.save_pretrained(str(folder), state_dict=adapters, is_main_process=True)  # type: ignore[operator]
        for adapter, entries in by_stage.items():  # PEFT wrote this stage's entries only
            from peft.utils import SAFETENSORS_WEIGHTS_NAME
            from safetensors.torch import save_file

            directory = Path(folder) if adapter == "default" else Path(folder) / adapter  # as PEFT places them
            save_file({name: value.contiguous() for name, value in entries.items()},
                      directory / SAFETENSORS_WEIGHTS_NAME, metadata={"format": "pt"})
    if dist.is_initialized():
        dist.barrier()
    return Path(folder)


def _named_by_each_stage(model: nn.Module, adapters: dict) -> dict[str, dict]:
    """Each adapter's entries as PEFT names them in its file, from every pipeline stage (a collective)."""
    from peft import get_peft_model_state_dict

    return {adapter: every_stage(model, get_peft_model_state_dict(model, state_dict=adapters, adapter_name=adapter))
            for adapter in model.peft_config}  # type: ignore[union-attr]
