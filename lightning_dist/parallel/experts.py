"""Mixture-of-experts layers whose experts are modules of their own (an `nn.ModuleList` named `experts`: Mixtral's
and Qwen2-MoE's layout before transformers fused them, DeepSeek's remote code, `model=gpt_moe`), under engines
that expect every rank to use the same parameters each step.

Such a layer calls only the experts its tokens chose, so on one rank an expert may run and on another not:
- DDP's reducer waits for a gradient that never comes (unless `find_unused_parameters`, which walks the graph
  every step);
- FSDP2 reduce-scatters the gradients a rank has: the ranks' collectives differ in size (gloo: "Received data size
  doesn't match expected size"; NCCL: a hang, or gradients added to the wrong ones);
- ZeRO-3 gathers each expert's parameters when it is called: the ranks that call it wait forever for one that does
  not (DeepSpeed #4808); made a leaf module, the layer gathers all of its experts at once (the DeepSpeed strategy
  does that: lightning_dist/strategies/deepspeed/experts.py, which also refuses ZeRO-1 and -2 for such layers).

`every_expert_in_backward` makes each such layer give every expert a gradient on every rank: after its forward, the
experts it did not call are added to its output times zero, so their gradients are zero where no token chose them,
the same on every engine (DeepSpeed's flat buffers give an unused parameter a zero gradient too). The cost is a sum
over the skipped experts' parameters, which the engines have gathered for the layer anyway.
"""

from __future__ import annotations

from typing import Any

from torch import nn

# Set on a layer once hooked: a strategy set up again (fit, then test) hooks nothing twice.
HOOKED = "lightning_dist_every_expert"


def expert_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The (name, module) of `model`'s layers with experts as modules: an `nn.ModuleList` named `experts`."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(getattr(module, "experts", None), nn.ModuleList) and len(module.experts) > 1]


def every_expert_in_backward(model: nn.Module) -> list[str]:
    """Hooks each expert layer of `model` (`expert_layers`) so that every expert gets a gradient on every rank; the
    names of the layers hooked."""
    hooked = []
    for name, layer in expert_layers(model):
        if not getattr(layer, HOOKED, False):
            _hook(layer)
        hooked.append(name)
    return hooked


def _hook(layer: nn.Module) -> None:
    experts: list[nn.Module] = list(getattr(layer, "experts"))
    called: set[int] = set()

    def record(expert: nn.Module, _: Any) -> None:
        called.add(id(expert))

    def start(_: nn.Module, __: Any) -> None:
        called.clear()

    def add_skipped(_: nn.Module, __: Any, output: Any) -> Any:
        skipped = [parameter for expert in experts if id(expert) not in called
                   for parameter in expert.parameters() if parameter.requires_grad]
        called.clear()
        if not skipped:
            return None
        first = output[0] if isinstance(output, tuple) else output
        # A tensor-parallel expert's parameters are DTensors: each rank's own part, with no collective.
        zero = sum(_local(parameter).sum() for parameter in skipped) * 0.0
        first = first + zero.to(first.dtype)
        return (first, *output[1:]) if isinstance(output, tuple) else first

    for expert in experts:
        expert.register_forward_pre_hook(record)
    layer.register_forward_pre_hook(start)
    layer.register_forward_hook(add_skipped)
    setattr(layer, HOOKED, True)


def count_routed_tokens(model: nn.Module) -> list[str]:
    """Hooks each of transformers' routers in `model` (a class of a `transformers` module whose name ends in `Router`,
    with `num_experts`, returning (logits, weights, each token's experts): Mixtral's, Qwen2/3-MoE's, OLMoE's and 35
    more models' `...TopKRouter`) so that it keeps its last forward's tokens per expert, `tokens_per_expert`, as
    `model=gpt_moe`'s layers do, for the training monitor. Counted on the device (a scatter: no host read). A router
    whose output is not that (transformers changed it) stops the step in one line. The names of the routers hooked;
    routers of other code are left alone (their layers may count their own, as `model=gpt_moe`'s do)."""
    hooked = []
    for name, router in model.named_modules():
        kind = type(router)
        if (kind.__module__.startswith("transformers.") and kind.__name__.endswith("Router")
                and isinstance(getattr(router, "num_experts", None), int)):
            if not hasattr(router, "tokens_per_expert"):
                router.tokens_per_expert = None
                router.register_forward_hook(_count_tokens)
            hooked.append(name)
    return hooked


def _count_tokens(router: nn.Module, _: Any, output: Any) -> None:
    import torch

    chosen = output[-1] if isinstance(output, tuple) else None
    if not isinstance(chosen, torch.Tensor) or chosen.is_floating_point():
        raise RuntimeError(f"{type(router).__name__} returned no experts' indices last (transformers' routers return"
                           " logits, weights, indices), so the training monitor cannot count its tokens per expert"
                           " (monitor/expert_load)")
    chosen = chosen.detach().flatten()
    experts: int = getattr(router, "num_experts")
    counts = torch.zeros(experts, dtype=torch.long, device=chosen.device)
    router.tokens_per_expert = counts.scatter_add_(0, chosen.long(), torch.ones_like(chosen, dtype=torch.long))


def _local(parameter: Any) -> Any:
    return parameter.to_local() if hasattr(parameter, "to_local") else parameter


def routed_shares(model: nn.Module) -> dict[int, float]:
    """The share of each expert parameter (by id) that a token uses: top k / experts, for the experts of every layer
    that says its k (`top_k`, or `num_experts_per_tok`, on the layer or its router `gate`), whether they are modules
    of their own or fused into 3-D parameters (transformers' `MixtralExperts`, whose first dimension is the experts)."""
    shares: dict[int, float] = {}
    for layer in model.modules():
        experts = getattr(layer, "experts", None)
        if not isinstance(experts, nn.Module):
            continue
        k = next((value for owner in (layer, getattr(layer, "gate", None)) for name in ("top_k", "num_experts_per_tok")
                  if isinstance(value := getattr(owner, name, None), int)), None)
        count = len(experts) if isinstance(experts, nn.ModuleList) else getattr(experts, "num_experts", None)
        if k is None or not isinstance(count, int) or not 0 < k <= count:
            continue
        for parameter in experts.parameters():
            shares[id(parameter)] = k / count
    return shares
