"""transformers' pipeline plans, as its models declare them: the base model's split in its config
(`base_model_pp_plan`, public), and the modules a task model runs after the base model (`_pp_plan`, a class attribute
of its causal LMs: `{"lm_head": (["hidden_states"], ["logits"])}`), read here and nowhere else. And a model's loss:
the function its `loss_function` property gives (one the user set on the model, else `LOSS_MAPPING[loss_type]`, the
causal LM's where the class name names no loss type), replaced for a step through the property's own setter.
And how its `from_pretrained` maps a checkpoint's names and tensors to a model's, how it learns that ZeRO-3
partitions its models (below), and which attention a model runs. Checked on transformers 5.24 and 5.25.
transformers is imported only where the user's model is one of its models."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning_dist._compat.fenced import Fenced

FENCED = [Fenced("transformers.loss.loss_utils", "LOSS_MAPPING"),
          Fenced("transformers.modeling_utils", "PreTrainedModel.loss_function"),
          # What DeepSpeed's AutoEP reads (_compat/deepspeed.py, autoep_reads_transformers_outputs).
          Fenced("transformers.utils.output_capturing", "_CAN_RECORD_REGISTRY"),
          Fenced("transformers.utils.output_capturing", "_CanRecordRegistry.get", ("self", "model")),
          # Which attention a model runs (attention_in_use).
          Fenced("transformers.configuration_utils", "PreTrainedConfig._attn_implementation"),
          Fenced("transformers.modeling_utils", "PreTrainedModel._supports_sdpa")]

CAUSAL_LM = "ForCausalLM"  # the loss type that shifts the labels by one token itself


def head_plan(model: Any) -> list[str]:
    """The modules `model` runs after its base model, in order (its `_pp_plan`); [] for a base model."""
    return list(getattr(model, "_pp_plan", None) or {})


def transformers_models(module: Any) -> list[Any]:
    """The transformers models in `module` (each has a `loss_function`, which those given `labels=` call)."""
    return [m for m in module.modules() if isinstance(getattr(type(m), "loss_function", None), property)]


def attention_in_use(model: Any) -> tuple[str | None, bool]:
    """The attention implementation `model` (a transformers model) runs, as its config says ("sdpa", "eager",
    "flash_attention_2", ...; None: not chosen yet), and whether its class has an SDPA one at all."""
    return model.config._attn_implementation, bool(type(model)._supports_sdpa)


def computes_router_loss(model: Any) -> bool:
    """Whether `model` (a transformers model) adds its routers' load-balancing loss when its config's
    `output_router_logits` asks for it: its modeling module defines `load_balancing_loss_func` (Mixtral's, Qwen-MoE's,
    GPT-OSS's, ...). DeepSeek-V2/V3's, GLM-4-MoE's and Llama 4's define none: their configs take the key and their
    forward never reads it. A model whose code is not transformers' own (a Hub repository's) is taken at its word:
    the step checks that the loss came."""
    import sys

    module = type(model).__module__
    return not module.startswith("transformers.models.") or callable(
        getattr(sys.modules.get(module), "load_balancing_loss_func", None))


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


# A checkpoint's tensors as transformers converts them into a model's (`conversion_mapping`): renamed
# (`.block_sparse_moe.` to `.mlp.`), or several made into one (Mixtral's experts' w1 and w3, one tensor each on the
# Hub, stacked into the fused `experts.gate_up_proj`). Checked on transformers 5.25.
FENCED += [Fenced("transformers.conversion_mapping", "get_model_conversion_mapping", ("model",)),
           Fenced("transformers.core_model_loading", "rename_source_key",
                  ("source_key", "weight_renamings", "weight_converters", "base_model_prefix", "meta_state_dict")),
           Fenced("transformers.core_model_loading", "dot_natural_key", ("s",)),
           Fenced("transformers.core_model_loading", "WeightConverter.add_tensor",
                  ("self", "target_key", "source_key", "source_pattern", "future")),
           Fenced("transformers.core_model_loading", "WeightConverter.convert", ("self", "layer_name"))]

# How GPT-OSS's published checkpoints hold its experts (MXFP4), unpacked as transformers' own
# `from_pretrained(quantization_config=Mxfp4Config(dequantize=True))` unpacks them.
FENCED += [Fenced("transformers.integrations.mxfp4", "convert_moe_packed_tensors", ("blocks", "scales"))]


def mxfp4_unpacked(blocks: Any, scales: Any, dtype: Any) -> Any:
    """The weights (experts, inputs, outputs) in `dtype` that MXFP4 `blocks` (experts, outputs, groups, 16 bytes:
    two 4-bit values a byte) and `scales` (experts, outputs, groups: a power of two + 127 for each 32 inputs) hold."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=dtype)


# Where one of a model's tensors comes from: (the converter's source pattern or None, the checkpoint's name), one
# pair for a tensor saved under its own or another name, several for one made from several.
Sources = tuple[tuple[str | None, str], ...]


def conversion_mapping(model: Any) -> list[Any]:
    """How transformers maps checkpoints' names and tensors to `model`'s ([] for a model not of transformers)."""
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_model_conversion_mapping

    return get_model_conversion_mapping(model) if isinstance(model, PreTrainedModel) else []


def checkpoint_sources(model: Any, mapping: list[Any], names: Iterable[str]) -> tuple[dict[str, Sources], list[str]]:
    """({the model's name of a tensor: its sources among `names`}, the names that are no tensor of the model),
    as transformers' `from_pretrained` maps them with `mapping` (`conversion_mapping(model)`)."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    state = model.state_dict(keep_vars=True)
    renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    prefix = getattr(model, "base_model_prefix", None) or None
    sources: dict[str, list[tuple[str | None, str]]] = {}
    unmatched = []
    for name in sorted(names, key=dot_natural_key):  # transformers' order: experts 0, 1, ..., 10
        renamed, pattern = rename_source_key(name, renamings, converters, prefix, state)
        if renamed not in state and name in state:  # a name the mapping should have left alone
            renamed, pattern = name, None
        if renamed in state and (pattern is not None or renamed not in sources):  # one source unless converted
            sources.setdefault(renamed, []).append((pattern, name))
        else:
            unmatched.append(name)
    return {name: tuple(found) for name, found in sources.items()}, unmatched


def converted(mapping: list[Any], name: str, sources: Sources, read: Callable[[str], Any]) -> Any:
    """The value of the model's tensor `name`: `read(checkpoint name)` of its one source, or its sources made into
    one by `mapping`'s converter (stacked, concatenated)."""
    (pattern, first), *more = sources
    if pattern is None and not more:
        return read(first)
    from copy import deepcopy

    converter = deepcopy(next(c for c in mapping if pattern in getattr(c, "source_patterns", ())))
    for source_pattern, source in sources:
        converter.add_tensor(name, source, source_pattern, lambda source=source: read(source))  # read as converted
    value = converter.convert(name)[name]
    return value[0] if isinstance(value, list) else value


def recapture_outputs_after_hooks_removed(module: Any) -> None:
    """transformers models in `module` install their output-capturing hooks again at their next forward. Lightning
    removes every module hook before it builds DeepSpeed's engine for a test after fit (`remove_module_hooks`),
    the ones transformers records router logits with included, while each model keeps its mark that they are
    installed: Mixtral's load-balancing loss then read no router logits ("IndexError: tuple index out of range" in
    `load_balancing_loss_func`). The mark is what transformers' own `maybe_install_capturing_hooks` reads; DeepSpeed's
    AutoEP clears it the same way when it swaps a MoE block. Checked on transformers 5.25."""
    for model in module.modules():
        if getattr(model, "_output_capturing_hooks_installed", False):
            model._output_capturing_hooks_installed = False


# What the memory plan's trace runs transformers' fused experts with on the meta device (grouped_experts_on_meta).
FENCED += [Fenced("transformers.integrations.moe", "_can_use_grouped_mm", ("input", "weight", "offs")),
           Fenced("transformers.integrations.moe", "grouped_mm_experts_forward",
                  ("self", "hidden_states", "top_k_index", "top_k_weights"))]


@contextmanager
def grouped_experts_on_meta(experts: Any) -> Iterator[None]:
    """Within: a transformers fused experts module runs its grouped implementation ("grouped_mm": the (token, expert)
    pairs sorted by expert, one product per expert over its rows), through the per-expert loop it falls back to,
    which has a shape rule for meta tensors; the eager one finds each expert's tokens with `nonzero`, which meta
    tensors cannot answer. The module's config (shared by the model's layers) is put back as it was. Checked on
    transformers 5.25."""
    from unittest import mock

    from transformers.integrations import moe

    config = experts.config
    chosen = config._experts_implementation
    config._experts_implementation = "grouped_mm"
    try:
        with mock.patch.object(moe, "_can_use_grouped_mm", lambda *args: False):
            yield
    finally:
        config._experts_implementation = chosen


# How transformers learns, outside its Trainer, that DeepSpeed ZeRO-3 partitions its models: a config object whose
# weak reference `set_hf_deepspeed_config` keeps (what its documented `HfDeepSpeedConfig` registers itself with),
# read back by `is_deepspeed_zero3_enabled` and `deepspeed_config`.
FENCED += [Fenced("transformers.integrations.deepspeed", "set_hf_deepspeed_config", ("hf_deepspeed_config_obj",)),
           Fenced("transformers.integrations.deepspeed", "is_deepspeed_zero3_enabled", ()),
           Fenced("transformers.integrations.deepspeed", "deepspeed_config", ()),
           Fenced("transformers.integrations.deepspeed", "unset_hf_deepspeed_config", ()),
           # The registered object itself (a weak reference, or None), put back when ours is withdrawn.
           Fenced("transformers.integrations.deepspeed", "_hf_deepspeed_config_weak_ref")]


class ZeRO3Declaration:
    """What transformers reads of a registered DeepSpeed config: whether it is ZeRO-3, and the config itself (which
    a `from_pretrained` while it is registered builds under `deepspeed.zero.Init` with). Registered only while an
    object holds it."""

    def __init__(self, config: dict[str, Any], replaced: Any = None) -> None:
        self.config = config
        self.replaced = replaced  # the user's registered config (not ZeRO-3), put back at withdrawal

    def is_zero3(self) -> bool:
        return True


def declare_zero3(config: dict[str, Any]) -> ZeRO3Declaration | None:
    """Tell transformers that ZeRO-3 partitions its models, as `HfDeepSpeedConfig(config)` does for a script without
    its Trainer (without needing accelerate, which that class imports); None where a ZeRO-3 config of the user's is
    registered already (one of another stage is replaced while the engine runs). Keep the returned object while the
    engine runs; `withdraw_zero3` ends it. Raises where transformers does not read it back (it then would not run
    `generate` in step on every rank). Checked on transformers 5.24 and 5.25."""
    from transformers.integrations import deepspeed

    if deepspeed.is_deepspeed_zero3_enabled():
        return None
    registered = deepspeed._hf_deepspeed_config_weak_ref
    declaration = ZeRO3Declaration(config, registered() if registered is not None else None)
    deepspeed.set_hf_deepspeed_config(declaration)
    if not deepspeed.is_deepspeed_zero3_enabled() or deepspeed.deepspeed_config() is not config:
        raise RuntimeError("transformers did not read back the ZeRO-3 config registered with set_hf_deepspeed_config:"
                           " its generate() would not keep the ranks in step under ZeRO-3 (a hang)")
    return declaration


def withdraw_zero3(declaration: ZeRO3Declaration) -> None:
    """transformers no longer takes its models to be partitioned by ZeRO-3: the config it read before is registered
    again, or none (where `declaration` is still the one it reads: a user's registered since is theirs)."""
    from transformers.integrations import deepspeed

    if deepspeed.deepspeed_config() is declaration.config:
        if declaration.replaced is not None:
            deepspeed.set_hf_deepspeed_config(declaration.replaced)
        else:
            deepspeed.unset_hf_deepspeed_config()
