"""A checkpoint saved under DeepSpeed's expert parallelism (AutoEP), in the model's own names: what
`lightning_dist.checkpoints.consolidate` writes for it, which then loads in a plain process and resumes under any
strategy and layout.

AutoEP swaps each mixture-of-experts block for a layer of its own: the router becomes `router.gate`, shared experts
`shared_experts`, and the experts three stacks split over the ranks of an expert-parallel group, w1 (gate) and w3
(up) [experts, ffn, hidden] and w2 (down) [experts, hidden, ffn]. DeepSpeed's universal form makes each whole
(checkpoints/universal_form.py); the names and shapes the model had, recorded when the run built its engine
(strategies/deepspeed/autoep.model_names, saved under AUTOEP_NAMES), turn them back. Transformers' fused
`gate_up_proj` is w1 and w3 stacked on the ffn dimension ([experts, 2 ffn, hidden], down [experts, hidden, ffn]),
or in the layout some models keep, transposed ([experts, hidden, 2 ffn], down [experts, ffn, hidden]). Every
parameter a block held comes back with its shape, or the conversion stops naming the first that does not.
"""

from __future__ import annotations

from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import torch

from lightning_dist.checkpoints.formats import CheckpointError
from lightning_dist.checkpoints.universal_form import convert_to_universal, saved_adam_step, universal_parameters

AUTOEP_NAMES = "autoep_model_names"  # the Lightning checkpoint's key for strategies/deepspeed/autoep.model_names
_MOMENTS = ("exp_avg", "exp_avg_sq")


def model_named_state(tag_dir: Path, client_state: dict[str, Any], path: Path,
                      ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """(fp32 state dict, Adam state by parameter name), both in the model's names, of the AutoEP checkpoint whose
    tag directory is `tag_dir` and whose rank-0 client state is `client_state`."""
    blocks = client_state.get(AUTOEP_NAMES)
    if not blocks:
        raise CheckpointError(
            f"checkpoint: {path} was saved under DeepSpeed's expert parallelism (AutoEP) by a lightning-dist that did"
            " not record the model's names of its layers; it resumes under the DeepSpeed strategy and"
            " strategy.expert_parallel_size it was saved with")  # also said before launch (contents.py)
    shapes = {name: shape for group in client_state["param_shapes"] for name, shape in group.items()}
    with TemporaryDirectory() as scratch:
        universal = Path(scratch) / "universal"
        convert_to_universal(tag_dir, universal, "checkpoint")
        found, step = universal_parameters(universal), saved_adam_step(universal)
    by_kind = {kind: {name: tensors[kind] for name, tensors in found.items() if kind in tensors}
               for kind in ("fp32", *_MOMENTS)}
    for tensors in by_kind.values():  # ZeRO keeps a parameter flat; AutoEP's experts came whole
        for name, tensor in tensors.items():
            if name in shapes and tensor.dim() == 1 and len(shapes[name]) != 1:
                tensors[name] = tensor.view(shapes[name])
    named = {kind: in_model_names(tensors, blocks) for kind, tensors in by_kind.items()}
    state_by_name = {}
    if step is not None and all(named[kind] for kind in _MOMENTS):
        state_by_name = {name: {"step": step.clone(), **{kind: named[kind][name] for kind in _MOMENTS}}
                         for name in named["fp32"]}
    return named["fp32"], state_by_name


def in_model_names(tensors: dict[str, torch.Tensor], blocks: dict[str, dict[str, Any]]) -> dict[str, torch.Tensor]:
    """`tensors` (AutoEP's names, each whole) in the model's names: each block in `blocks` turned back by
    `_block_in_model_names`, everything else as it is."""
    named = {name: tensor for name, tensor in tensors.items() if not any(name.startswith(f"{b}.") for b in blocks)}
    for block, layout in blocks.items():
        held = {name.removeprefix(f"{block}."): tensor for name, tensor in tensors.items()
                if name.startswith(f"{block}.")}
        named.update({f"{block}.{name}": tensor for name, tensor in _block_in_model_names(block, held, layout).items()})
    return named


def _block_in_model_names(block: str, held: dict[str, torch.Tensor], layout: dict[str, Any]) -> dict[str, torch.Tensor]:
    expected = {name: list(shape) for name, shape in layout["parameters"].items()}
    named = _experts_in_model_names(block, held, layout, expected)
    # The router and the shared experts are AutoEP's modules by other names (the router's weights copied whole).
    renames = {"router.gate": layout["router"], "shared_experts": layout["shared_experts"],
               "shared_experts_gate": layout["shared_experts_gate"]}
    for name, tensor in held.items():
        if name in expected:
            named[name] = tensor
            continue
        owner = next((ours for ours in renames if name.startswith(f"{ours}.") and renames[ours]), None)
        if owner is None:
            raise CheckpointError(f"checkpoint: AutoEP's {block}.{name} has no place in the model's {block} (it held"
                                  f" {', '.join(sorted(expected))}); report this with your DeepSpeed version")
        named[f"{renames[owner]}.{name.removeprefix(f'{owner}.')}"] = tensor
    for name, shape in expected.items():
        if name not in named or list(named[name].shape) != shape:
            found = "nothing" if name not in named else f"shape {list(named[name].shape)}"
            raise CheckpointError(f"checkpoint: the model's {block}.{name} {shape} came back from AutoEP's layer as"
                                  f" {found}; report this with your DeepSpeed version")
    return named


def _experts_in_model_names(block: str, held: dict[str, torch.Tensor], layout: dict[str, Any],
                            expected: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """The experts' stacks w1, w2, w3 (taken out of `held`) under the model's names and in its layout."""
    experts = layout["experts"]
    gate, down, up = (held.pop(f"experts.{w}", None) for w in ("w1", "w2", "w3"))
    if gate is None or down is None or up is None:
        return {}  # a model whose experts AutoEP did not take: nothing of theirs to name
    gate_name, down_name = f"{experts}.{layout['w1']}", f"{experts}.{layout['w2']}"
    if layout["w3"]:  # gate, up and down apart, as AutoEP keeps them
        return {gate_name: gate, down_name: down, f"{experts}.{layout['w3']}": up}
    count, ffn, hidden = gate.shape
    fused_shape, down_shape = expected.get(gate_name), expected.get(down_name)
    if fused_shape == [count, 2 * ffn, hidden] and down_shape == [count, hidden, ffn]:
        return {gate_name: torch.cat([gate, up], dim=1), down_name: down}
    if fused_shape == [count, hidden, 2 * ffn] and down_shape == [count, ffn, hidden]:
        return {gate_name: torch.cat([gate, up], dim=1).transpose(1, 2).contiguous(),
                down_name: down.transpose(1, 2).contiguous()}
    raise CheckpointError(f"checkpoint: AutoEP's experts of {block} ({count} x {ffn} x {hidden}) fit neither fused"
                          f" layout of the model's {gate_name} {fused_shape} and {down_name} {down_shape}")


def in_autoep_names(tensors: dict[str, torch.Tensor], blocks: dict[str, dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The inverse of `in_model_names`: `tensors` in the model's names (a checkpoint of another strategy or layout)
    in the names of AutoEP's layers, each expert stack whole ([experts, ...]: a rank takes its own experts)."""
    named = {name: tensor for name, tensor in tensors.items() if not any(name.startswith(f"{b}.") for b in blocks)}
    for block, layout in blocks.items():
        held = {name.removeprefix(f"{block}."): tensor for name, tensor in tensors.items()
                if name.startswith(f"{block}.")}
        renames = {layout["router"]: "router.gate", layout["shared_experts"]: "shared_experts",
                   layout["shared_experts_gate"]: "shared_experts_gate"}
        found = {w: held.pop(f"{layout['experts']}.{layout[w]}", None) for w in ("w1", "w2", "w3") if layout[w]}
        if all(tensor is not None for tensor in found.values()):  # else absent: the strict load names them
            experts = {w: tensor for w, tensor in found.items() if tensor is not None}
            named.update({f"{block}.experts.{w}": tensor for w, tensor in _expert_stacks(experts, layout).items()})
        for name, tensor in held.items():
            ours = next((model for model in renames if model and name.startswith(f"{model}.")), None)
            autoep = name if ours is None else f"{renames[ours]}.{name.removeprefix(f'{ours}.')}"
            named[f"{block}.{autoep}"] = tensor
    return named


def _expert_stacks(experts: dict[str, torch.Tensor], layout: dict[str, Any]) -> dict[str, torch.Tensor]:
    """AutoEP's w1, w2, w3 ([experts, ffn, hidden], [experts, hidden, ffn]) from the model's experts."""
    if layout["w3"]:
        return {"w1": experts["w1"], "w2": experts["w2"], "w3": experts["w3"]}
    fused, down = experts["w1"], experts["w2"]
    if fused.shape[1] == 2 * down.shape[2] and fused.shape[2] == down.shape[1]:  # [E, 2 ffn, hidden]
        gate, up = fused.chunk(2, dim=1)
        return {"w1": gate.contiguous(), "w3": up.contiguous(), "w2": down}
    gate, up = fused.transpose(1, 2).chunk(2, dim=1)  # [E, hidden, 2 ffn], down [E, ffn, hidden]
    return {"w1": gate.contiguous(), "w3": up.contiguous(), "w2": down.transpose(1, 2).contiguous()}
