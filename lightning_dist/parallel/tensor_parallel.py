"""Tensor parallelism from a plan: module-name patterns mapped to how each layer is split across the ranks of a
tensor-parallel group, as transformers writes its models' `base_model_tp_plan` ("layers.*.self_attn.q_proj":
"colwise").

- colwise: a linear layer's output features are split; each rank computes its share of them (its attention heads,
  its slice of the MLP's hidden layer) from the whole input.
- rowwise: its input features are split, as the colwise layer before it left them; the partial outputs are summed
  across the group, so the layer's output is whole on every rank again.
- colwise_gather_output, rowwise_split_input: the same splits of the weight, with the output gathered whole on every
  rank (a colwise layer whose output something needs whole: OLMo2's norm over every head's queries, Phi-3's fused
  projections, Qwen3.5's linear attention) and the whole input split on each rank before the rowwise layer after it.
- replicated_with_grad_allreduce: a layer kept whole on every rank that sees only its rank's share of the heads
  (Qwen3's and Gemma 3's q and k norms, one weight per head dimension applied to every head): each rank's gradient
  holds its own heads' part, and the parts are summed over the group. torch's `SequenceParallel` over the heads
  dimension does this (as torchtitan splits Qwen3's norms): the weight is a replicated DTensor, its input the rank's
  share of the heads, its gradient a partial sum that FSDP2 reduces over the group before it reduces over the data.
- mla_kv_a_proj: DeepSeek's latent attention (DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash, MiniCPM3): the layer is kept
  whole; of its output, the rotary key (its last `qk_rope_head_dim` features) goes to every head unsplit, so each rank's
  gradient of it is its own heads' part, summed over the group in the backward pass (the rest goes through a colwise
  layer, whose input gradient torch sums already).

A colwise layer followed by a rowwise one is Megatron-LM's split of an attention or MLP block: one all-reduce in
forward and one in backward per block, and a model whose code splits heads by `view(..., -1, head_dim)` runs
unchanged on its local share. Layers the plan does not name (embeddings, norms, the output head) stay whole on every
rank of the group and are sharded by FSDP over the data-parallel axis only.

Where a plan comes from, first found: the strategy's own (`strategy.tensor_parallel_plan`, patterns from the
LightningModule), or a `tp_plan` attribute of a module of the model, patterns relative to that module: the bundled
GPT has one, and so has every transformers model with a `base_model_tp_plan` (Llama, Qwen2, Mistral, ...). Of a
model's own plan, the layers in these styles are split; the embedding and the output head stay whole (transformers'
vocabulary-parallel `embedding_rowwise`, and the head's `colwise_gather_output`: a head tied to the embedding would be
untied by a split of one of them), which gives the same results.

A plan is a module's own: a wrapper that hands on the attributes it lacks (PEFT's `PeftModel`) answers with the plan of
the model inside, whose patterns start there, not at the wrapper. A PEFT LoRA layer that a plan names is split as
Megatron-LM splits LoRA: a colwise layer's base layer and its up factor B (r -> out) by their output features, the
down factor A whole; a rowwise layer's base layer and A (in -> r) by their input features, B whole. Each rank adds its
share of the adapter's output to its share of the base layer's, so the model is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_dist._compat.peft import TUNED_LAYER, is_tuner_layer, lora_linear_factors

SPLIT_STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input")
SPLITS_OUTPUTS = ("colwise", "colwise_gather_output")  # the others split a layer's input features
SUMMED = "replicated_with_grad_allreduce"  # transformers' names for these, in its models' plans
ROTARY_KEY_SUMMED = "mla_kv_a_proj"
KEPT_WHOLE = (SUMMED, ROTARY_KEY_SUMMED)
EMBEDDING = "embedding_rowwise"  # transformers' vocabulary-parallel embedding: kept whole here
ROTARY_KEY_MARK = "lightning_dist_rotary_key_summed"  # on the layer, as logged_means.py marks its own
STYLES = (*SPLIT_STYLES, *KEPT_WHOLE)
TensorParallelPlan = dict[str, str]


def check_plan(plan: Any, key: str) -> TensorParallelPlan:
    """`plan` as {pattern: style}, or ValueError naming `key`, the entry and the valid styles."""
    if not isinstance(plan, dict) or not plan:
        raise ValueError(f"{key}: give module-name patterns mapped to a style ({', '.join(STYLES)}), e.g."
                         " {'blocks.*.attn.q': 'colwise', 'blocks.*.attn.proj': 'rowwise'}")
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"{key}.{pattern}={style}: no such style; choose one of: {', '.join(STYLES)}")
    return {str(pattern): str(style) for pattern, style in plan.items()}


def find_plan(model: nn.Module, configured: TensorParallelPlan | None) -> tuple[str, TensorParallelPlan] | None:
    """The plan for `model` with its patterns relative to `model` ("where it came from", plan), or None."""
    if configured:
        return "strategy.tensor_parallel_plan", configured
    for name, module in model.named_modules():
        plan = _own_plan(module)
        if isinstance(plan, dict) and (plan := {pattern: style for pattern, style in plan.items()
                                                if style in STYLES and not _names_output_head(module, pattern)}) \
                and any(style in SPLIT_STYLES for style in plan.values()):
            prefix = f"{name}." if name else ""
            return f"{type(module).__name__}.tp_plan", {prefix + pattern: style for pattern, style in plan.items()}
    return None


def _names_output_head(module: nn.Module, pattern: str) -> bool:
    """Whether `pattern` names the output head of `module` (a transformers model's `lm_head`)."""
    head_of = getattr(module, "get_output_embeddings", None)
    head = head_of() if callable(head_of) else None
    return head is not None and any(_matches(name, pattern) for name, layer in module.named_modules() if layer is head)


def summed_layers(model: nn.Module) -> tuple[str, list[str]] | None:
    """The class of a module whose own plan keeps layers of `model` replicated with their gradients summed over the
    ranks (Qwen3's per-head q and k norms), and those patterns; None where there are none."""
    kept = _kept_whole_layers(model, (SUMMED,))
    return None if kept is None else (kept[0], list(kept[1]))


def _kept_whole_layers(model: nn.Module, styles: tuple[str, ...] = KEPT_WHOLE) -> tuple[str, dict[str, str]] | None:
    """The class of a module whose own plan keeps layers of `model` whole with (part of) their gradients summed over
    the ranks, in `styles`, and those patterns with their styles; None where there are none."""
    for name, module in model.named_modules():
        plan = _own_plan(module)
        if isinstance(plan, dict):
            prefix = f"{name}." if name else ""
            kept = {prefix + pattern: style for pattern, style in plan.items() if style in styles}
            if present := {pattern: style for pattern, style in kept.items()
                           if not unmatched_patterns(model, {pattern: style})}:
                return type(module).__name__, present
    return None


def _beside(pattern: str, others: list[str]) -> list[str]:
    """Those of `others` in the same module as `pattern` (q_norm and k_norm beside q_proj)."""
    return [other for other in others if other.rpartition(".")[0] == pattern.rpartition(".")[0]]


def own_plan_styles(model: nn.Module) -> tuple[str, TensorParallelPlan] | None:
    """The class of the first module of `model` with a plan of its own, and that plan without its output head's
    entry (kept whole here); None where no module has one."""
    for module in model.modules():
        plan = _own_plan(module)
        if isinstance(plan, dict) and plan:
            return type(module).__name__, {str(pattern): str(style) for pattern, style in plan.items()
                                           if not _names_output_head(module, pattern)}
    return None


def _own_plan(module: nn.Module) -> Any:
    """The `tp_plan` that `module`'s class or the module itself defines, not one a wrapper hands on from inside."""
    if "tp_plan" in vars(module) or any("tp_plan" in vars(klass) for klass in type(module).__mro__):
        return getattr(module, "tp_plan", None)
    return None


def matched_modules(model: nn.Module, plan: TensorParallelPlan) -> dict[str, nn.Module]:
    """Every module of `model` a pattern of `plan` names (a `*` stands for one name between dots)."""
    return {name: module for name, module in model.named_modules() if any(_matches(name, p) for p in plan)}


def split_modules(model: nn.Module, plan: TensorParallelPlan) -> dict[str, nn.Module]:
    """The modules of `model` that `plan` splits (a style of `SPLIT_STYLES`), not those it keeps whole."""
    return matched_modules(model, {pattern: style for pattern, style in plan.items() if style in SPLIT_STYLES})


def unmatched_patterns(model: nn.Module, plan: TensorParallelPlan) -> list[str]:
    """The patterns of `plan` that name no module of `model` (a plan for another model, or a typo)."""
    names = [name for name, _ in model.named_modules()]
    return [pattern for pattern in plan if not any(_matches(name, pattern) for name in names)]


def _parameter_patterns(model: nn.Module, patterns: list[str]) -> tuple[str, str] | None:
    """The first of `patterns` that names a parameter, not a module, and the class of the module holding it."""
    for name, _ in model.named_parameters():
        owner, _, _ = name.rpartition(".")
        for pattern in patterns:
            if _matches(name, pattern):
                return pattern, type(model.get_submodule(owner)).__name__
    return None


def split_sizes(model: nn.Module, plan: TensorParallelPlan, size: int) -> list[str]:
    """What `size` ranks cannot split evenly, one line per planned layer: its split features, or its attention
    heads (a colwise layer of a module with a `head_dim`, as the bundled GPT's and transformers' attention have)."""
    problems = []
    parents = {name: module for name, module in model.named_modules()}
    for name, module in split_modules(model, plan).items():
        style = next(style for pattern, style in plan.items() if _matches(name, pattern))
        if is_tuner_layer(module):  # split as its base layer is (with_lora_factors refuses the tuners it cannot)
            module = getattr(module, TUNED_LAYER)
        if not isinstance(module, nn.Linear):
            problems.append(f"{name} is a {type(module).__name__}, and a {style} split takes an nn.Linear")
            continue
        features = module.out_features if style in SPLITS_OUTPUTS else module.in_features
        head_dim = getattr(parents.get(name.rpartition(".")[0]), "head_dim", None)
        if features % size:
            problems.append(f"{name} ({style}) has {features} {'output' if style in SPLITS_OUTPUTS else 'input'}"
                            f" features, which {size} ranks do not split evenly")
        elif style == "colwise" and isinstance(head_dim, int) and (features // size) % head_dim:
            problems.append(f"{name} has {features // head_dim} attention head(s), which {size} ranks do not"
                            " split evenly")
        elif style == "colwise" and isinstance(head_dim, int) and (per_head := _per_head_parameter(
                parents[name.rpartition(".")[0]], features // head_dim)):
            owner = name.rpartition(".")[0]
            problems.append(f"{owner}.{per_head} holds one value per attention head, which a split of {name}'s"
                            " heads leaves whole on every rank (GPT-OSS's attention sinks); train the model without"
                            " tensor parallelism")
    return problems


def _per_head_parameter(attention: nn.Module, heads: int) -> str | None:
    """The name of a parameter `attention` holds itself (not in a layer the plan splits) with one entry per head of
    its `heads`, or None: a split of the heads would leave it whole, and the model would fail to combine the two."""
    return next((name for name, parameter in attention.named_parameters(recurse=False)
                 if parameter.dim() == 1 and parameter.shape[0] == heads > 1), None)


def per_head_parameter(model: nn.Module) -> str | None:
    """The first parameter of `model` that an attention module (one with a `head_dim`) holds itself with one entry
    per head of one of its projections (GPT-OSS's attention sinks), by name; None where there is none. A split of
    the heads by name rules (DeepSpeed AutoTP's) leaves it whole."""
    for name, module in model.named_modules():
        head_dim = getattr(module, "head_dim", None)
        if not isinstance(head_dim, int) or head_dim < 1:
            continue
        for heads in {features // head_dim for layer in module.children()
                      if isinstance(features := getattr(layer, "out_features", None), int)}:
            if per_head := _per_head_parameter(module, heads):
                return f"{name}.{per_head}"
    return None


def resolve_plan(model: nn.Module, configured: TensorParallelPlan | None, size: int) -> TensorParallelPlan:
    """The plan for `model` (`configured`, or its own), checked: every pattern names a layer, and `size` ranks split
    each layer and its attention heads evenly. ValueError, in one line naming the key, otherwise."""
    found = find_plan(model, configured)
    if configured is not None and (kept := _kept_whole_layers(model)):
        owner, styles = kept
        for pattern, style in configured.items():
            missing = [other for other in _beside(pattern, list(styles)) if other not in configured]
            if style == "colwise" and missing:
                raise ValueError(
                    f"strategy.tensor_parallel_plan: {pattern} splits the heads of {' and '.join(missing)}, which"
                    f" {owner}.tp_plan keeps whole on every rank with their gradients summed over the tensor-parallel"
                    " ranks (each rank's gradient is its own heads' part); add "
                    + ", ".join(f"'{layer}': {styles[layer]}" for layer in missing) + " to the plan, or leave the"
                    " attention whole")
    if found is None and (other := own_plan_styles(model)):
        if per_head := per_head_parameter(model):  # no plan that splits its heads can run
            raise ValueError(f"strategy.tensor_parallel_size={size}: {per_head} holds one value per attention head,"
                             " which a split of the heads would leave whole on every rank (GPT-OSS's attention"
                             f" sinks), and {other[0]}.tp_plan splits no layer; train the model without tensor"
                             " parallelism")
        own_styles = sorted(set(other[1].values()))
        splits = ("splits only its embedding (embedding_rowwise), which stays whole here" if own_styles == [EMBEDDING]
                  else f"splits its layers in styles this tensor parallelism does not run ({', '.join(own_styles)}: it"
                       f" splits layers {', '.join(SPLIT_STYLES)})")
        raise ValueError(
            f"strategy.tensor_parallel_size={size}: {other[0]}.tp_plan {splits}; set strategy.tensor_parallel_plan"
            " (module-name patterns mapped to colwise or rowwise), or train the model without tensor parallelism")
    if found is None:
        raise ValueError(
            f"strategy.tensor_parallel_size={size}: {type(model).__name__} has no tensor-parallel plan (a `tp_plan`"
            " attribute); set strategy.tensor_parallel_plan (module-name patterns mapped to colwise or rowwise), or"
            " split the model yourself in configure_model"
        )
    source, plan = found
    unmatched = unmatched_patterns(model, plan)
    if source != "strategy.tensor_parallel_plan" and not _parameter_patterns(model, unmatched) and (
            len(unmatched) < len(plan)):
        # A model's own plan covers every layer its config can build: Qwen2-MoE's and Qwen3-MoE's name the dense
        # MLP of their `mlp_only_layers`, which a model whose every layer has experts does not have. Those entries
        # split nothing here, as transformers skips them; a plan that names none of the model's layers is refused.
        plan, unmatched = {pattern: style for pattern, style in plan.items() if pattern not in unmatched}, []
    if unmatched:
        if fused := _parameter_patterns(model, unmatched):
            # transformers' mixture-of-experts models keep their experts fused (one tensor of every expert's
            # weights, `experts.down_proj`); their plans split those by their own styles, which this split lacks.
            rest = ",".join(f"{pattern}:{style}" for pattern, style in plan.items() if pattern not in unmatched)
            raise ValueError(f"{source}: {fused[0]} names a parameter of {fused[1]} (its experts fused in one"
                             " tensor), not a layer: tensor parallelism here splits nn.Linear layers; set"
                             f" strategy.tensor_parallel_plan to the plan without the experts ({{{rest}}}), or train"
                             " the model under fsdp")
        example = next((name for name, module in model.named_modules() if isinstance(module, nn.Linear)), "")
        raise ValueError(f"{source}: {', '.join(unmatched)} names no module of {type(model).__name__} (patterns"
                         f" start at the LightningModule: its first linear layer is {example})")
    if problems := split_sizes(model, plan, size):
        more = f" (and {len(problems) - 1} more layers)" if len(problems) > 1 else ""
        raise ValueError(f"strategy.tensor_parallel_size={size}: {problems[0]}{more}")
    return with_lora_factors(model, plan, source)


def with_lora_factors(model: nn.Module, plan: TensorParallelPlan, source: str) -> TensorParallelPlan:
    """`plan` with each PEFT LoRA layer it names replaced by the parts split the layer's way (the module docstring):
    those layers by name, the plan's other layers by its own patterns. ValueError naming any other PEFT layer."""
    expanded: TensorParallelPlan = {}
    for pattern, style in plan.items():
        matched = {name: module for name, module in model.named_modules() if _matches(name, pattern)}
        if style in KEPT_WHOLE or not any(is_tuner_layer(module) for module in matched.values()):
            expanded[pattern] = style
            continue
        for name, module in matched.items():
            factors = lora_linear_factors(module)
            if factors is None and is_tuner_layer(module):
                raise ValueError(f"{source}: {name} is PEFT's {type(module).__name__}, which tensor parallelism"
                                 " does not split: only LoRA's Linear layers (not DoRA's); leave it out of"
                                 " target_modules, or out of the plan (strategy.tensor_parallel_plan)")
            if factors is None:
                expanded[name] = style
                continue
            down, up = factors
            for part in (TUNED_LAYER, *(up if style in SPLITS_OUTPUTS else down)):
                expanded[f"{name}.{part}"] = style
    return expanded


def model_unsplit(facts: Any, tp: int) -> str | None:
    """Why a model's layers cannot be split over `tp` ranks, read from its facts (memory/model_facts.py: the
    parameters of the layers its plan splits), or None."""
    if facts.tensor_parallel_parameters == facts.tensor_parallel_frozen == 0:
        return "the model has no tensor-parallel plan (a `tp_plan` attribute)"
    return None


def activations_held(activations: float, tp: int, layout: Any) -> float:
    """What one of `tp` ranks saves of a step's `activations` (the memory planner's): tensor parallelism splits
    what attention and the MLP save, not the residual stream and the norms' inputs: 10 + 24/t of a transformer
    block's 34 units (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
    without sequence parallelism). A checkpointed block saves only its input, which it does not split."""
    return activations if layout.activation_checkpointing else activations * (10 + 24 / tp) / 34


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh, plan: TensorParallelPlan) -> None:
    """Split the layers `plan` names across `mesh` (1-D: the tensor-parallel axis). Before activation checkpointing
    and FSDP, as torchtitan orders them; on the meta device too (nothing is allocated)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    styles: dict[str, Callable[[], ParallelStyle]] = {
        "colwise": ColwiseParallel, "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        # Any dimension but the last, which a per-head norm normalizes, gives the same local result and the same
        # summed gradient: the heads of Qwen3's (batch, tokens, heads, head_dim), the tokens of Gemma 3's (batch,
        # heads, tokens, head_dim).
        SUMMED: lambda: SequenceParallel(sequence_dim=-2, use_local_output=True),
    }
    trainable = {name: param.requires_grad for name, param in model.named_parameters()}
    parallelize_module(model, mesh, {pattern: styles[style]() for pattern, style in plan.items()
                                     if style != ROTARY_KEY_SUMMED})
    sum_rotary_key_gradients(model, matched_modules(model, {p: s for p, s in plan.items() if s == ROTARY_KEY_SUMMED}),
                             mesh)
    # SequenceParallel makes each parameter anew as a trainable one: a frozen norm (LoRA's base) trained, silently
    # (measured: Qwen3 with LoRA under fsdp_tp 1e-5 off the data-parallel losses at step 1). Frozen stays frozen.
    for name, param in model.named_parameters():
        param.requires_grad_(trainable[name])
    summed = matched_modules(model, {pattern: style for pattern, style in plan.items() if style == SUMMED})
    if unsummed := [name for name, module in summed.items()
                    if any(not isinstance(param, DTensor) for param in module.parameters())]:
        raise RuntimeError(f"tensor parallelism: {unsummed[0]} kept plain weights where its gradients are to be"
                           " summed over the tensor-parallel ranks (torch's SequenceParallel placed none)")


def rotary_key_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The layers of `model` that its own plan keeps whole with their rotary key's gradient summed (`mla_kv_a_proj`)."""
    kept = _kept_whole_layers(model, (ROTARY_KEY_SUMMED,))
    return {} if kept is None else matched_modules(model, kept[1])


def sum_rotary_key_gradients(model: nn.Module, layers: dict[str, nn.Module], mesh: DeviceMesh) -> None:
    """Each of `layers` (DeepSeek's latent-attention projections, by name in `model`) with its rotary key's gradient
    summed over `mesh` in the backward pass."""
    for name, layer in layers.items():
        _sum_rotary_key_gradient(layer, _rotary_key_features(model, name), mesh)


def _rotary_key_features(model: nn.Module, name: str) -> int:
    """The rotary key's width in the output of DeepSeek's latent-attention layer `name`: its attention's
    `qk_rope_head_dim`. ValueError where the attention has none."""
    attention = model.get_submodule(name.rpartition(".")[0])
    features = getattr(attention, "qk_rope_head_dim", None)
    if not isinstance(features, int) or not 0 < features < getattr(model.get_submodule(name), "out_features", 0):
        raise ValueError(f"tensor parallelism: {name} is planned as {ROTARY_KEY_SUMMED} (its output's last"
                         f" qk_rope_head_dim features summed in backward), but {type(attention).__name__} has no"
                         " qk_rope_head_dim within that output")
    return features


def _sum_rotary_key_gradient(layer: nn.Module, features: int, mesh: DeviceMesh) -> None:
    """The last `features` of `layer`'s output unchanged forward, their gradient summed over `mesh` backward (once: a
    second set-up of the same module, fit after fit, would sum it twice)."""
    from torch.distributed.tensor import Partial, Replicate

    if getattr(layer, ROTARY_KEY_MARK, False):
        return

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        kept, rotary = output.split([output.shape[-1] - features, features], dim=-1)
        # A replicated DTensor whose local gradient is declared partial: the gradient is all-reduced on its way back.
        summed = DTensor.from_local(rotary, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
        return torch.cat([kept, summed], dim=-1)

    layer.register_forward_hook(hook)
    setattr(layer, ROTARY_KEY_MARK, True)


def _matches(name: str, pattern: str) -> bool:
    # parallelize_module's own rule: pattern and name have as many parts, and each part matches.
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(fnmatchcase(part, want) for part, want in zip(parts, wanted))
