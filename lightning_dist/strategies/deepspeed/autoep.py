"""DeepSpeed's expert parallelism (AutoEP) under Lightning: `strategy.expert_parallel_size` on the DeepSpeed presets,
or a config file's `expert_parallel` section.

AutoEP swaps each mixture-of-experts block of a transformers model it has a preset for (Mixtral, Qwen3-MoE,
DeepSeek-V2/V3, ...) for its own layer, which holds experts / size of them on each rank of an expert-parallel group
and sends each token to its experts by all-to-all; ZeRO then partitions what is left as usual. Measured on DeepSpeed
0.19.8 (CPU ranks, a config-built Mixtral with its load-balancing loss): ZeRO-1, 2 and 3 train the unsplit model's
losses.

AutoEP finds the blocks by their names under the model `deepspeed.initialize` is given, and reads that model's
`config`. Lightning gives it the LightningModule, where the transformers model sits a level or more down
(`model.`) and there is no `config`: it found no MoE layer. So the blocks' pattern is anchored at the transformers
model's place, and its config is lent to the module while the engine is built; the blocks swapped are then counted
against the model's experts, and a run where AutoEP missed one stops in one line.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from lightning_dist._compat.deepspeed import autoep_reads_transformers_outputs
from lightning_dist._compat.transformers import transformers_models
from lightning_dist.parallel.expert_parallel import KEY, experts_modules
from lightning_dist.parallel.expert_parallel import refusal as experts_refusal

SECTION = "expert_parallel"
_NONE = object()


def autoep_size(config: dict[str, Any]) -> int:
    """The expert-parallel size a resolved DeepSpeed config runs: its AutoEP section's, 1 where it is off."""
    section = config.get(SECTION) or {}
    return int(section.get("autoep_size", 1)) if section.get("enabled") else 1


def presets() -> dict[str, tuple[str, ...]]:
    """AutoEP's presets: name -> the transformers `model_type`s each stands for."""
    from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS

    return {name: tuple(preset.hf_model_types) for name, preset in PRESET_MODELS.items()}


def preset_of(model_type: str | None) -> str | None:
    return next((name for name, types in presets().items() if model_type in types), None)


def transformers_moe_model(model: nn.Module) -> tuple[str, Any] | None:
    """(its name in `model`, the model) of the outermost transformers model AutoEP has a preset for."""
    known = {id(m) for m in transformers_models(model) if preset_of(getattr(m.config, "model_type", None))}
    return next(((name, m) for name, m in model.named_modules() if id(m) in known), None)


def model_refusal(model: nn.Module, size: int, partitions_weights: bool) -> str | None:
    """Why AutoEP cannot split `model`'s experts over `size` ranks, in one line naming the key; None when it can.
    `partitions_weights`: under ZeRO-3, whose checkpoints under AutoEP hold no frozen expert weight: DeepSpeed 0.19.8
    trained a LoRA fine-tune of Mixtral (its experts frozen) and stopped at the first save."""
    if why := experts_refusal(model, size):
        return why
    if transformers_moe_model(model) is None:
        names = ", ".join(presets())
        return (f"{KEY}={size}: DeepSpeed's expert parallelism (AutoEP) splits transformers MoE models it has a preset"
                f" for ({names}); {type(model).__name__} holds none. FSDP's splits any layer that calls its experts"
                " as experts(hidden_states, top_k_index, top_k_weights): strategy=fsdp")
    frozen = [name for name, module in experts_modules(model) if not all(p.requires_grad for p in module.parameters())]
    if partitions_weights and frozen:
        return (f"{KEY}={size}: {frozen[0]} is frozen (a LoRA fine-tune's base), and DeepSpeed's ZeRO-3 checkpoints"
                " under AutoEP hold no frozen expert weights (its first save stops the run); split the experts under"
                f" FSDP (strategy=fsdp {KEY}={size}), or train them")
    return None


def swapped_layers(module: nn.Module) -> list[str]:
    """The names of the layers AutoEP swapped in `module`."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer  # here: importing DeepSpeed takes seconds

    return [name for name, layer in module.named_modules() if isinstance(layer, AutoEPMoELayer)]


def local_experts(module: nn.Module) -> dict[str, list[int]]:
    """{name of each layer AutoEP swapped in `module`: the experts this rank holds, in the order of its stacks}."""
    from deepspeed.checkpoint.autoep_affine import autoep_experts_for_rank
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    return {name: list(autoep_experts_for_rank(layer.expert_placement_descriptor, layer.ep_rank))
            for name, layer in module.named_modules() if isinstance(layer, AutoEPMoELayer)}


def experts_to_split(config: dict[str, Any], module: nn.Module) -> list[str]:
    """The experts modules AutoEP is to take over in `module` under `config` ([] where it is off), read before ZeRO-3
    partitions their parameters; ValueError in one line where it cannot (a model built in configure_model, which
    the check before launch did not see)."""
    size = autoep_size(config)
    if size == 1 or swapped_layers(module):  # off, or swapped already: a test after fit builds its engine again
        return []
    if why := model_refusal(module, size, partitions_weights=(config.get("zero_optimization") or {}).get("stage") == 3):
        raise ValueError(why)
    return [name for name, _ in experts_modules(module)]


def model_names(config: dict[str, Any], module: nn.Module, experts: list[str]) -> dict[str, dict[str, Any]]:
    """Where AutoEP's layers keep what each block held, read before it swaps them (experts_to_split's `experts`):
    per block, the model's names of its router, experts (AutoEP's w1, w2, w3) and shared experts, and every parameter
    the block holds with its shape. Saved with each checkpoint (checkpoints/autoep_names.py reads it back into the
    model's names); {} where AutoEP is off."""
    found = transformers_moe_model(module) if experts else None
    if found is None:
        return {}
    from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS

    preset = PRESET_MODELS[(config.get(SECTION) or {}).get("preset_model") or preset_of(found[1].config.model_type)]
    patterns = {"router": preset.router_pattern, "shared_experts": preset.shared_experts_pattern,
                "shared_experts_gate": preset.shared_experts_gate_pattern}
    names = {}
    for experts_name in experts:
        block_name, experts_child = experts_name.rsplit(".", 1)
        block = module.get_submodule(block_name)
        children = [name for name, _ in block.named_children()]
        names[block_name] = {
            **{role: next((child for child in children if pattern and re.fullmatch(pattern, child)), None)
               for role, pattern in patterns.items()},
            "experts": experts_child, "w1": preset.expert_w1, "w2": preset.expert_w2, "w3": preset.expert_w3,
            "parameters": {name: list(parameter.shape) for name, parameter in block.named_parameters()},
        }
    return names


@contextmanager
def autoep_finds_the_blocks(config: dict[str, Any], module: nn.Module, expected: list[str]) -> Iterator[None]:
    """While the engine is built from `config` around `module` (the LightningModule): AutoEP's layer pattern
    anchored at the transformers model's place in it, that model's config lent to the module, and transformers'
    recorder registry readable as AutoEP reads it. Afterwards each experts module `expected` (experts_to_split) must
    have been swapped for AutoEP's layer; RuntimeError in one line if one was not."""
    found = transformers_moe_model(module) if expected else None
    if found is None:  # AutoEP is off, or the engine is built again (a test after fit) around layers it swapped
        yield
        return
    size = autoep_size(config)
    place, hf_model = found
    preset = preset_of(hf_model.config.model_type)
    from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS

    section = config[SECTION]
    as_given = dict(section)  # put back after: a test after fit builds its engine from the same config
    section.setdefault("preset_model", preset)
    pattern = section.get("moe_layer_pattern") or PRESET_MODELS[section["preset_model"]].moe_layer_pattern
    section["moe_layer_pattern"] = re.escape(f"{place}.") + pattern
    own = module.__dict__.get("config", _NONE)  # a module's own `config` (users keep theirs there) is put back
    module.__dict__["config"] = hf_model.config
    try:
        with autoep_reads_transformers_outputs():
            yield
    finally:
        if own is _NONE:
            del module.__dict__["config"]
        else:
            module.__dict__["config"] = own
        anchored = section["moe_layer_pattern"]
        section.clear()
        section.update(as_given)
    swapped = {f"{name}.experts" for name in swapped_layers(module)}
    missed = [name for name in expected if name not in swapped]
    if missed:
        raise RuntimeError(f"{KEY}={size}: DeepSpeed's AutoEP did not take over {missed[0]}"
                           f" (its pattern {anchored!r}), so its experts would not be split;"
                           " report this with your DeepSpeed and transformers versions")
