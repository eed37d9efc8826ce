"""Mixture-of-experts layers with experts as modules of their own (lightning_dist/parallel/experts.py) under ZeRO: what
each stage needs from them."""

from __future__ import annotations

from typing import Any

from lightning_dist.parallel.experts import expert_layers


def expert_layers_as_leaves(model: Any) -> None:
    """Each layer of `model` with experts as modules (lightning_dist/parallel/experts.py) made a ZeRO-3 leaf module,
    whose parameters are gathered all at once when it is called: otherwise a rank whose tokens chose none of an
    expert never gathers it, and the ranks that call it wait for that rank forever (DeepSpeed #4808). What users
    of DeepSpeed do by hand (`set_z3_leaf_modules(model, [MixtralSparseMoeBlock])`), checked afterwards."""
    from deepspeed.utils import set_z3_leaf_modules, z3_leaf_module  # here: importing DeepSpeed takes seconds

    layers = expert_layers(model)
    if not layers:
        return
    set_z3_leaf_modules(model, list({type(layer) for _, layer in layers}))
    unmarked = [name for name, layer in layers if not z3_leaf_module(layer)]
    if unmarked:
        raise RuntimeError(f"ZeRO-3: the expert layer {unmarked[0]} could not be made a leaf module, so a rank whose"
                           " tokens skip one of its experts would leave the others waiting; report this with your"
                           " DeepSpeed version")


def refuse_expert_layers_under_zero_1_2(model: Any, stage: int) -> None:
    """ZeRO-1 and -2 reduce each bucket of gradients in the order they arrived (ZeRO-3 sorts its buckets first): a
    layer that skips an expert on one rank and calls it on another makes the orders differ, and experts of the same
    size then have each other's gradients added (measured: ddp's losses from step 1 on, 1.5e-3 apart, no error).
    Refused in one line until the buckets are ordered."""
    layers = expert_layers(model) if stage in (1, 2) else []
    if layers:
        raise ValueError(f"ZeRO stage {stage}: {layers[0][0]} calls only the experts its tokens chose, so the ranks'"
                         f" gradients reach ZeRO-{stage}'s buckets in different orders and would be summed with each"
                         " other's; use ZeRO-3 (strategy=deepspeed_stage_3, which orders its buckets) or fsdp")
