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

from lightning_dist._compat.torch import TorchDispatchMode, autocast_on_meta, storage_identity, storage_owner, tree_map
from lightning_dist.memory.attention_kernel import fused_attention
from lightning_dist.memory.hidden_size import hidden_size_of
from lightning_dist.memory.routed_experts import RoutedExperts, experts_traced_on_meta
from lightning_dist.parallel.activation_checkpoint import KEPT_OPS, CheckpointPlan
from lightning_dist.parallel.classes import block_modules
from lightning_dist.parallel.context_parallel import position_modules
from lightning_dist.parallel.expert_parallel.layers import experts_count, experts_modules
from lightning_dist.parallel.pretrained_weights import BoundWeights


@dataclass(frozen=True)
class BlockActivations:
    """What one block saves for backward in one training step, in bytes (fp32)."""

    saved: int     # everything it saves
    inputs: int    # its inputs: what a checkpointed block keeps
    products: int  # of `saved`, the outputs of its matrix products and attention: what op-level checkpointing keeps


@dataclass(frozen=True)
class ModelFacts:
    parameters: int                            # trainable elements, shared (tied) parameters once
    # Elements that do not train (a LoRA model's pretrained base, frozen layers): held as weights, with no gradients
    # and no optimizer state. Counted apart, or a LoRA fine-tune's plan would leave out the whole base model.
    frozen_parameters: int = 0
    frozen_16bit_parameters: int = 0           # of those, held in 16 bits: they stay so under every precision
    largest_block: int = 0                     # elements of the largest repeated block: the unit gathered at once
    largest_block_experts: int = 0             # of those, its experts': expert parallelism gathers 1 / ep of them
    blocks: int = 0                            # how many blocks: pipeline stages divide them
    buffer_bytes: int = 0
    activation_bytes: int | None = None        # saved for backward by one micro-batch, fp32
    checkpointed_activation_bytes: int | None = None  # the same with each block recomputed in backward
    optimizer: str = "adamw"                   # what configure_optimizers returns, as the planner names it
    parameter_sizes: tuple[int, ...] = ()      # elements of each parameter, frozen ones included: ZeRO-3 keeps the
                                               # small ones whole
    hidden_size: int | None = None             # from the hyper-parameters: ZeRO-3 presets size buckets by it
    most_parameters_per_module: int = 1        # fetched together: ZeRO-Infinity's swap pool must hold them at once
    # Trainable elements of the layers tensor parallelism splits (the model's `tp_plan`, else the linear layers of its
    # blocks, as DeepSpeed's AutoTP splits them); None: unknown, every parameter counted as split. And the frozen ones.
    tensor_parallel_parameters: int | None = None
    tensor_parallel_frozen: int = 0
    block_activations: tuple[BlockActivations, ...] = ()  # per block, in model order: selective checkpointing's
    # Context parallelism's terms, from the traced step: (query heads, key/value heads, sequence length) of its
    # attention calls (the fewest heads; the shortest sequence), and whether the model's positions can follow a shard.
    attention: tuple[int, int, int] | None = None
    positions: bool = False
    # Elements of the largest tensor the model reads from a pretrained folder as it is set up (0: none): each rank
    # holds its rows of it while it loads, or twice all of it where it keeps it whole (memory/planner.py).
    pretrained_largest: int = 0
    # Of `parameters`, those one token's step uses: a mixture of experts' top-k of each layer's experts, and the rest
    # (routed_experts.py). None for a model without experts.
    active_parameters: int | None = None
    fewest_experts: int = 0  # the fewest experts of a mixture-of-experts layer (0: none): expert parallelism divides it

    def activations_under(self, plan: CheckpointPlan | None) -> int | None:
        """Bytes saved for backward by one micro-batch with `plan`'s blocks checkpointed (None: none are). Each
        checkpointed block keeps its inputs (and, op-level, its products); backward recomputes one at a time."""
        if plan is None or self.activation_bytes is None:
            return self.activation_bytes
        if not self.block_activations:  # facts given without the per-block trace: every block's figure
            return self.checkpointed_activation_bytes
        checkpointed = [b for index, b in enumerate(self.block_activations) if plan.checkpoints(index)]
        kept_products = [b.products if plan.ops else 0 for b in checkpointed]
        kept = sum(b.inputs + products for b, products in zip(checkpointed, kept_products))
        recomputed = max((b.saved - products for b, products in zip(checkpointed, kept_products)), default=0)
        return self.activation_bytes - sum(b.saved for b in checkpointed) + kept + recomputed

    @classmethod
    def of(
        cls, build: Callable[[], nn.Module], batch: Any = None, block_classes: tuple[type[nn.Module], ...] = ()
    ) -> "ModelFacts":
        """`build()` runs under the meta device; `batch` (one training batch, any device) sizes the activations."""
        with torch.device("meta"):
            module = build()
        params = _unique_parameters(module)
        trained = [p for p in params if p.requires_grad]
        blocks = block_modules(module, block_classes)
        attention: list[tuple[int, int, int]] = []
        routed = RoutedExperts([])
        try:
            if batch is not None:
                with experts_traced_on_meta(module) as routed:
                    traced = _trace_activations(module, batch, blocks, attention)
            else:
                traced = None
        except NotImplementedError as error:
            if "nonzero" not in str(error):
                raise
            # Tokens chosen by their values (a routing of its own, not an experts module's call), which meta lacks.
            raise ValueError(f"{type(module).__name__} chooses tokens by value in its forward (torch.nonzero), which"
                             " the memory plan's trace on the meta device cannot follow; the plan, the dry run and"
                             " strategy=auto_fit do not know such models yet") from None
        trainable = sum(p.numel() for p in trained)
        largest = max(((sum(p.numel() for p in b.parameters()), _experts_elements(b)) for b in blocks), default=(0, 0))
        split, split_frozen = _split_by_tensor_parallelism(module, blocks)
        return cls(
            parameters=trainable,
            active_parameters=trainable - routed.inactive_parameters() if routed.modules and traced else None,
            fewest_experts=min((experts_count(m) for _, m in experts_modules(module)), default=0),
            frozen_parameters=sum(p.numel() for p in params if not p.requires_grad),
            frozen_16bit_parameters=sum(p.numel() for p in params if not p.requires_grad and p.element_size() == 2),
            largest_block=largest[0],
            largest_block_experts=largest[1],
            blocks=len(blocks),
            buffer_bytes=sum(b.numel() * b.element_size() for b in module.buffers()),
            activation_bytes=traced[0] if traced else None,
            checkpointed_activation_bytes=traced[1] if traced else None,
            block_activations=traced[2] if traced else (),
            optimizer=_optimizer_kind(module),
            parameter_sizes=tuple(p.numel() for p in params),
            hidden_size=hidden_size_of(module),
            most_parameters_per_module=max(len(list(m.parameters(recurse=False))) for m in module.modules()),
            tensor_parallel_parameters=split,
            tensor_parallel_frozen=split_frozen,
            attention=_fewest(attention),
            positions=bool(position_modules(module)),
            pretrained_largest=_largest_pretrained_tensor(module),
        )


def _experts_elements(block: nn.Module) -> int:
    return sum(p.numel() for _, experts in experts_modules(block) for p in experts.parameters())


def _fewest(calls: list[tuple[int, int, int]]) -> tuple[int, int, int] | None:
    """The fewest query heads, key/value heads and tokens over the attention calls: what context parallelism must
    divide."""
    return (min(c[0] for c in calls), min(c[1] for c in calls), min(c[2] for c in calls)) if calls else None


def _split_by_tensor_parallelism(module: nn.Module, blocks: list[nn.Module]) -> tuple[int, int]:
    """(trainable, frozen) elements of the layers tensor parallelism splits."""
    from lightning_dist.parallel.tensor_parallel import find_plan, split_modules

    found = find_plan(module, None)
    layers = (split_modules(module, found[1]).values() if found
              else [m for block in blocks for m in block.modules() if isinstance(m, nn.Linear)])
    params = {id(p): p for layer in layers for p in layer.parameters()}.values()
    return (sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params if not p.requires_grad))


def _optimizer_kind(module: nn.Module) -> str:
    configure = getattr(module, "configure_optimizers", None)
    optimizer = configure() if configure is not None else None
    optimizer = optimizer[0] if isinstance(optimizer, (list, tuple)) else optimizer
    optimizer = optimizer.get("optimizer") if isinstance(optimizer, dict) else optimizer
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd_momentum" if any(g.get("momentum") for g in optimizer.param_groups) else "sgd"
    return "adamw"  # Adam and its kin: two moments per parameter


def _largest_pretrained_tensor(module: nn.Module) -> int:
    bound = [weights for m in module.modules() if isinstance(weights := getattr(m, "pretrained_weights", None),
                                                              BoundWeights)]
    return max((b.largest() for b in bound), default=0)


def _unique_parameters(module: nn.Module) -> list[nn.Parameter]:
    return list({id(p): p for p in module.parameters()}.values())


def _trace_activations(
    module: nn.Module, batch: Any, blocks: list[nn.Module], attention: list[tuple[int, int, int]], device: str = "meta"
) -> tuple[int, int, tuple[BlockActivations, ...]]:
    """(bytes saved for backward, bytes saved with each block checkpointed, what each block saves) by one training
    step on meta (`device`: a module there, to check the trace against a real step); each attention call's heads and
    length into `attention`."""
    parameters = {id(p) for p in module.parameters()}
    seen: set[int] = set()
    counted: list[torch.Tensor] = []
    per_block = {id(b): [0, 0, 0] for b in blocks}  # saved, inputs, products
    current: list[int] = []  # the block being run, innermost last
    products: list[torch.Tensor] = []  # kept alive, so that no other storage takes one's identity
    product_storages: set[int] = set()
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        base = storage_owner(tensor)
        if id(base) not in parameters and id(base) not in seen:
            seen.add(id(base))
            # Kept to the end: a part of the graph the step drops (a branch whose output is not used) frees its
            # tensors, whose ids a later tensor may take, which was then not counted (seen on Mixtral, 6% short).
            counted.append(base)
            size = base.numel() * base.element_size()
            total += size
            if current:
                per_block[current[-1]][0] += size
                if storage_identity(base) in product_storages:
                    per_block[current[-1]][2] += size
        return tensor

    def product(tensor: torch.Tensor) -> None:
        products.append(tensor)
        product_storages.add(storage_identity(tensor))

    def enter(block: nn.Module, args: tuple) -> None:
        current.append(id(block))
        per_block[id(block)][1] += sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))

    def leave(block: nn.Module, args: tuple, output: Any) -> None:
        current.pop()

    meta_batch = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)
    with ExitStack() as stack:
        for block in blocks:
            stack.callback(block.register_forward_pre_hook(enter).remove)
            stack.callback(block.register_forward_hook(leave).remove)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        stack.enter_context(fused_attention(attention))  # meta has no fused kernel: its math path saves T x T weights
        stack.enter_context(autocast_on_meta())  # LoRA on fused experts turns autocast off on its weights' device
        stack.enter_context(_OutputsOf(KEPT_OPS, product))
        stack.enter_context(mock.patch.object(type(module), "log", lambda *a, **k: None, create=True))
        step = getattr(module, "training_step", None)
        step(meta_batch, 0) if step is not None else module(meta_batch)
    traced = tuple(BlockActivations(*per_block[id(b)]) for b in blocks)
    # Checkpointed: each block keeps only its input; backward recomputes one block at a time.
    checkpointed = (
        total - sum(b.saved for b in traced) + sum(b.inputs for b in traced) + max((b.saved for b in traced), default=0)
    )
    return total, checkpointed, traced


class _OutputsOf(TorchDispatchMode):
    """Within: `record(tensor)` for every tensor output of the ops in `ops`."""

    def __init__(self, ops: frozenset, record: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        self.ops, self.record = ops, record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        if func in self.ops:
            for tensor in output if isinstance(output, (tuple, list)) else (output,):
                if isinstance(tensor, torch.Tensor):
                    self.record(tensor)
        return output
