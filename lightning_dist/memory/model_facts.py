"""What the planner needs to know about a model, read from it on the meta device: nothing is allocated.

Parameters and buffers are counted from the module; activations are traced by running one training step on meta
tensors and adding up what autograd saves for backward (the parameters themselves excluded), per repeated block,
so that activation checkpointing's saving can be computed rather than guessed.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable
from unittest import mock

import torch
from torch import nn

from lightning_dist._compat.torch import storage_owner, tree_map
from lightning_dist.deepspeed_config.facts import hidden_size_of
from lightning_dist.parallel.classes import block_modules


@dataclass(frozen=True)
class ModelFacts:
    parameters: int                            # trainable elements, shared (tied) parameters once
    largest_block: int = 0                     # elements of the largest repeated block: the unit gathered at once
    buffer_bytes: int = 0
    activation_bytes: int | None = None        # saved for backward by one micro-batch, fp32
    checkpointed_activation_bytes: int | None = None  # the same with each block recomputed in backward
    optimizer: str = "adamw"                   # what configure_optimizers returns, as the planner names it
    parameter_sizes: tuple[int, ...] = ()      # elements of each parameter: ZeRO-3 keeps the small ones whole
    hidden_size: int | None = None             # from the hyper-parameters: ZeRO-3 presets size buckets by it
    most_parameters_per_module: int = 1        # fetched together: ZeRO-Infinity's swap pool must hold them at once
    # Elements of the layers tensor parallelism splits (the model's `tp_plan`, else the linear layers of its blocks,
    # as DeepSpeed's AutoTP splits them); None: unknown, every parameter counted as split.
    tensor_parallel_parameters: int | None = None

    @classmethod
    def of(cls, build: Callable[[], nn.Module], batch: Any = None, block_classes: tuple[type[nn.Module], ...] = ()) -> "ModelFacts":
        """`build()` runs under the meta device; `batch` (one training batch, any device) sizes the activations."""
        with torch.device("meta"):
            module = build()
        params = [p for p in _unique_parameters(module) if p.requires_grad]
        blocks = block_modules(module, block_classes)
        activations = _trace_activations(module, batch, blocks) if batch is not None else None
        return cls(
            parameters=sum(p.numel() for p in params),
            largest_block=max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0),
            buffer_bytes=sum(b.numel() * b.element_size() for b in module.buffers()),
            activation_bytes=activations[0] if activations else None,
            checkpointed_activation_bytes=activations[1] if activations else None,
            optimizer=_optimizer_kind(module),
            parameter_sizes=tuple(p.numel() for p in params),
            hidden_size=hidden_size_of(module),
            most_parameters_per_module=max(len(list(m.parameters(recurse=False))) for m in module.modules()),
            tensor_parallel_parameters=_split_by_tensor_parallelism(module, blocks),
        )


def _split_by_tensor_parallelism(module: nn.Module, blocks: list[nn.Module]) -> int:
    from lightning_dist.parallel.tensor_parallel import find_plan, matched_modules

    found = find_plan(module, None)
    layers = (matched_modules(module, found[1]).values() if found
              else [m for block in blocks for m in block.modules() if isinstance(m, nn.Linear)])
    return sum(p.numel() for layer in layers for p in layer.parameters() if p.requires_grad)


def _optimizer_kind(module: nn.Module) -> str:
    configure = getattr(module, "configure_optimizers", None)
    optimizer = configure() if configure is not None else None
    optimizer = optimizer[0] if isinstance(optimizer, (list, tuple)) else optimizer
    optimizer = optimizer.get("optimizer") if isinstance(optimizer, dict) else optimizer
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd_momentum" if any(g.get("momentum") for g in optimizer.param_groups) else "sgd"
    return "adamw"  # Adam and its kin: two moments per parameter


def _unique_parameters(module: nn.Module) -> list[nn.Parameter]:
    return list({id(p): p for p in module.parameters()}.values())


def _trace_activations(module: nn.Module, batch: Any, blocks: list[nn.Module]) -> tuple[int, int]:
    """(bytes saved for backward, bytes saved with each block checkpointed) by one training step on meta."""
    parameters = {id(p) for p in module.parameters()}
    seen: set[int] = set()
    per_block = {id(b): 0 for b in blocks}
    block_inputs = 0
    current: list[int] = []  # the block being run, innermost last
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        base = storage_owner(tensor)
        if id(base) not in parameters and id(base) not in seen:
            seen.add(id(base))
            size = base.numel() * base.element_size()
            total += size
            if current:
                per_block[current[-1]] += size
        return tensor

    def enter(block: nn.Module, args: tuple) -> None:
        nonlocal block_inputs
        current.append(id(block))
        block_inputs += sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))

    def leave(block: nn.Module, args: tuple, output: Any) -> None:
        current.pop()

    meta_batch = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, batch)
    with ExitStack() as stack:
        for block in blocks:
            stack.callback(block.register_forward_pre_hook(enter).remove)
            stack.callback(block.register_forward_hook(leave).remove)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        stack.enter_context(mock.patch.object(type(module), "log", lambda *a, **k: None, create=True))
        step = getattr(module, "training_step", None)
        step(meta_batch, 0) if step is not None else module(meta_batch)
    in_blocks = sum(per_block.values())
    # Checkpointed: each block keeps only its input; backward recomputes one block at a time.
    checkpointed = total - in_blocks + block_inputs + max(per_block.values(), default=0)
    return total, checkpointed
