"""A model split into pipeline stages without user code: the blocks the strategy already knows (`block_class`),
and the model's own way in and out of them.

The module that holds the block stack (the trunk: our GPT, a Hugging Face decoder) says how its input enters the
blocks and how their output leaves: `embed(*inputs) -> hidden` and `head(hidden) -> outputs`, so that its forward is
`head(block_n(... block_1(embed(inputs))))`. Each rank keeps only what its stages run, pruned from the model while
it is still on the meta device: its blocks (keeping their place in the stack, so every name is the whole model's:
`blocks.5.attn.q.weight` stays that), the trunk's modules before the stack on the first stage (embeddings), those
after it on the last (final norm, head). Modules without parameters (rotary tables) stay everywhere.

A stage is a `StageView`: the modules of one stage, registered there so that the stage owns exactly its parameters
(the schedule scales and FSDP shards by the stage's own), running the trunk's `embed`, its blocks and `head`.

A parameter the model shares between its first and last stage (GPT-2's output head tied to the token embedding)
is held by each as a copy: `TiedCopies` starts them equal and sums their gradients, as Megatron-LM does with its
embedding group, so that every copy takes the same step as the shared parameter would.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_dist.optim.parameter_groups import decays_as_embedding
from lightning_dist.parallel.pipeline_layout import PipelineLayout

_NEEDS = "embed(*inputs) -> hidden and head(hidden) -> outputs"

# The pipeline's process group of each module this rank's stages hold, while they run: a stage holds its part of the
# model, so what gathers the whole model (checkpoints/gather.py) gathers across the pipeline too. Keyed by module,
# never by parameter: a weak reference to a tensor stops `module.to()` from swapping it (torch 2.11: "Cannot swap t1
# because it has weakref associated with it", as trainer.test after trainer.fit moves the sharded model).
_STAGE_GROUPS: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def hold_stages(module: nn.Module, group: Any) -> None:
    """`module` and each of its submodules are this rank's stages' of a pipeline over `group`."""
    for held in module.modules():
        _STAGE_GROUPS[held] = group


def stage_group(module: nn.Module) -> Any:
    """The pipeline group over which `module` is split into stages, or None where it is whole on this rank."""
    return next((group for held in module.modules() if (group := _STAGE_GROUPS.get(held)) is not None), None)


@dataclass(frozen=True)
class Trunk:
    """Where a model's block stack is: the trunk (the module the model's step calls, which holds the stack) by its
    name in the model ("" for the model itself), and the stack's path in the trunk: `blocks` for our GPT,
    `model.layers` for a transformers `LlamaForCausalLM`. `kind` says how a stage runs through the trunk: "own"
    (its `embed` and `head`) or "transformers" (the base model's forward, pipeline_transformers)."""

    name: str
    stack: str
    kind: str = "own"

    def of(self, model: nn.Module) -> nn.Module:
        return model.get_submodule(self.name)

    def stack_of(self, model: nn.Module) -> nn.ModuleList:
        stack = self.of(model).get_submodule(self.stack)
        assert isinstance(stack, nn.ModuleList)
        return stack

    def ends(self, model: nn.Module) -> tuple[dict[str, nn.Module], dict[str, nn.Module]]:
        """The modules with parameters that run before the blocks (the first stage's) and after them (the last
        stage's), by their path in the trunk: at each module on the way down to the stack, its children before the
        way and after it. Modules without parameters (rotary tables) are in neither: every stage keeps them."""
        before: dict[str, nn.Module] = {}
        after: dict[str, nn.Module] = {}
        module, prefix = self.of(model), ""
        for step in self.stack.split("."):
            names = [name for name, _ in module.named_children()]
            at = names.index(step)
            for position, name in enumerate(names):
                child = module.get_submodule(name)
                if position != at and _has_parameters(child):
                    (before if position < at else after)[prefix + name] = child
            module, prefix = module.get_submodule(step), f"{prefix}{step}."
        return before, after


def find_trunk(model: nn.Module, block_classes: tuple[type[nn.Module], ...], key: str) -> Trunk:
    """The one `nn.ModuleList` of blocks in `model` and the trunk holding it: its parent if that says how to enter
    and leave the blocks, else the outermost transformers model around it with a pipeline plan; else ValueError in
    one line saying what the model needs."""
    stacks = [
        name for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) and all(isinstance(m, block_classes) for m in module)
    ]
    names = ", ".join(cls.__qualname__ for cls in block_classes)
    if len(stacks) != 1:
        found = "none" if not stacks else f"{len(stacks)} ({', '.join(stacks)})"
        raise ValueError(f"{key}: pipeline stages split one nn.ModuleList of the model's blocks ({names});"
                         f" found {found}")
    parent_name, _, stack = stacks[0].rpartition(".")
    parent = model.get_submodule(parent_name)
    missing = [method for method in ("embed", "head") if not callable(getattr(parent, method, None))]
    if not missing:
        return Trunk(parent_name, stack)
    path = stacks[0].split(".")
    for depth in range(len(path) - 1):  # outermost first: the model the step calls
        name = ".".join(path[:depth])
        if has_pipeline_plan(model.get_submodule(name)):
            return Trunk(name, ".".join(path[depth:]), "transformers")
    raise ValueError(f"{key}: {type(parent).__name__} (the module holding {stacks[0]}) must define {_NEEDS},"
                     f" so that each stage can run its part (or be a transformers model with a pipeline plan);"
                     f" it lacks {' and '.join(missing)}")


def has_pipeline_plan(module: nn.Module) -> bool:
    """Whether `module` is a transformers model whose config says how its base model splits into stages."""
    return bool(getattr(getattr(module, "config", None), "base_model_pp_plan", None)) and hasattr(module, "base_model")


def tied_parameters(model: nn.Module) -> list[list[str]]:
    """The names of each parameter that `model` holds under more than one name, first as `named_parameters` lists it."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def prune_to_stages(model: nn.Module, trunk: Trunk, layout: PipelineLayout, stages: Iterable[int]) -> None:
    """Remove from `model` what none of `stages` runs. The blocks that stay keep their indices as names; a module
    before or after the blocks becomes an `nn.Identity` (the trunk's forward may still pass through it)."""
    stages = list(stages)
    stack = trunk.stack_of(model)
    kept = {block for stage in stages for block in layout.blocks_of_stage(stage)}
    for index, (key, _) in enumerate(list(stack.named_children())):
        if index not in kept:
            delattr(stack, key)  # not `del stack[index]`, which renumbers the blocks after it
    before, after = trunk.ends(model)
    owner = trunk.of(model)
    dropped = ([] if 0 in stages else list(before)) + ([] if layout.stages - 1 in stages else list(after))
    for path in dropped:
        parent, _, name = path.rpartition(".")
        setattr(owner.get_submodule(parent), name, nn.Identity())


def untie_across_stages(model: nn.Module, tied: list[list[str]]) -> None:
    """Give every name of a tied parameter that this rank still holds its own parameter (the copies that
    `TiedCopies` keeps equal): two stages on one rank must not share one, which each stage's FSDP would claim."""
    held = dict(model.named_parameters(remove_duplicate=False))
    for group in tied:
        present = [name for name in group if name in held]
        for name in present[1:]:
            module_name, _, attr = name.rpartition(".")
            param = held[name]
            copy = nn.Parameter(torch.empty_like(param), requires_grad=param.requires_grad)
            setattr(model.get_submodule(module_name), attr, copy)


class StageView(nn.Module):
    """One pipeline stage of a pruned model: its blocks (by their index in the whole stack) and, on the first and
    last stage, the trunk's modules before and after the stack, registered here so that the stage owns exactly its
    parameters. Its forward is the trunk's: `embed` on the first stage, the blocks, `head` on the last (or the
    transformers model's own forward over the stage's layers: pipeline_transformers)."""

    def __init__(self, model: nn.Module, trunk: Trunk, layout: PipelineLayout, stage: int) -> None:
        super().__init__()
        stack = trunk.stack_of(model)
        self.blocks = nn.ModuleDict({str(i): stack.get_submodule(str(i)) for i in layout.blocks_of_stage(stage)})
        self.is_first, self.is_last = stage == 0, stage == layout.stages - 1
        before, after = trunk.ends(model)
        ends = {**(before if self.is_first else {}), **(after if self.is_last else {})}
        self.ends = nn.ModuleDict({path.replace(".", "_"): module for path, module in ends.items()})
        self.trunk: Any
        object.__setattr__(self, "trunk", trunk.of(model))  # not a submodule: its other parameters are other stages'
        self.stage = stage
        self.runs: Callable[[StageView, tuple, dict], Any] = _runs_own_trunk
        if trunk.kind == "transformers":
            from lightning_dist.parallel.pipeline_transformers import TransformersStage

            self.runs = TransformersStage(trunk, after)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.runs(self, inputs, kwargs)

    def answer(self, output: Any, args: tuple, kwargs: dict) -> Any:
        """What the step's call of the trunk with `args` and `kwargs` returns, this last stage's `output` given."""
        answers = getattr(self.runs, "answer", None)
        return output if answers is None else answers(self.trunk, output, args, kwargs)


def _runs_own_trunk(view: StageView, inputs: tuple, kwargs: dict) -> Any:
    hidden = view.trunk.embed(*inputs, **kwargs) if view.is_first else inputs[0]
    for block in view.blocks.values():
        hidden = block(hidden)
    return view.trunk.head(hidden) if view.is_last else hidden


class TiedCopies:
    """The copies of tied parameters held by different stages, kept equal: at the start each takes the value of
    the first name's copy, and after each backward every copy's gradient becomes their sum.

    The copies of one parameter lie on the pipeline ranks of one coordinate of the other axes; each such set of
    ranks has its process group (made by every rank, in one order, as torch requires)."""

    def __init__(self, model: nn.Module, tied: list[list[str]], holders: list[list[int]], pp_ranks: list[int],
                 groups_by_rank: dict[frozenset[int], Any]) -> None:
        """`holders`: the pipeline positions holding each name; `pp_ranks`: the global ranks of this rank's
        pipeline, by position."""
        held = dict(model.named_parameters(remove_duplicate=False))
        self.names = [list(group) for group in tied]
        self.entries: list[tuple[list[nn.Parameter], bool, Any]] = []
        for names, positions in zip(tied, holders):
            present = [held[name] for name in names if name in held]
            if present:
                ranks = frozenset(pp_ranks[position] for position in positions)
                self.entries.append((present, names[0] in held, groups_by_rank.get(ranks) if len(ranks) > 1 else None))

    @staticmethod
    def groups(pp_ranks_by_coordinate: list[list[int]], holders: list[list[int]]) -> dict[frozenset[int], Any]:
        """Every process group any rank's copies reduce over: for each set of pipeline positions holding copies,
        one group per coordinate of the other axes. Called by every rank in the same order."""
        made: dict[frozenset[int], Any] = {}
        positions = sorted({tuple(sorted(set(ranks))) for ranks in holders if len(set(ranks)) > 1})
        for pp_ranks in pp_ranks_by_coordinate:
            for position in positions:
                ranks = sorted(pp_ranks[p] for p in position)
                made[frozenset(ranks)] = dist.new_group(ranks)
        return made

    @torch.no_grad()
    def start_equal(self) -> None:
        for params, has_first, group in self.entries:
            value = _local(params[0]).clone() if has_first else torch.zeros_like(_local(params[0]))
            if group is not None:
                dist.all_reduce(value, group=group)
            for param in params:
                _local(param).copy_(value)

    @torch.no_grad()
    def sum_gradients(self) -> None:
        for params, _, group in self.entries:
            grads = [param.grad for param in params if param.grad is not None]
            if len(grads) < len(params):
                continue
            total = _local(grads[0]).clone()
            for grad in grads[1:]:
                total += _local(grad)
            if group is not None:
                dist.all_reduce(total, group=group)
            for grad in grads:
                _local(grad).copy_(total)

    def duplicates(self) -> set[int]:
        """The ids of the copies beyond each parameter's first: a norm over the model counts each parameter once."""
        return {id(param) for params, has_first, _ in self.entries for param in params[1 if has_first else 0:]}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (its copies on other stages are sharded alike), or the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@dataclass(frozen=True)
class PipelineSplit:
    """A model's split: where its blocks are, the layout, the stages this rank holds, and its tied parameters with
    the pipeline ranks holding each name."""

    trunk: Trunk
    layout: PipelineLayout
    stages: tuple[int, ...]
    tied: tuple[tuple[str, ...], ...]
    holders: tuple[tuple[int, ...], ...]
    embeddings: tuple[bool, ...]  # whether each tied parameter is an embedding's weight

    @classmethod
    def of(cls, model: nn.Module, trunk: Trunk, layout: PipelineLayout, pp_rank: int) -> PipelineSplit:
        tied = tuple(tuple(group) for group in tied_parameters(model))
        split = cls(trunk, layout, tuple(layout.stages_of_rank(pp_rank)), tied, (), ())
        holders = tuple(tuple(layout.rank_of_stage(split.stage_of(model, name)) for name in group) for group in tied)
        embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        held = dict(model.named_parameters(remove_duplicate=False))
        embeddings = tuple(id(held[group[0]]) in embedding_weights for group in tied)
        return cls(trunk, layout, split.stages, tied, holders, embeddings)

    def stage_of(self, model: nn.Module, name: str) -> int:
        """The stage that runs parameter `name`: its block's, or the first or last for the trunk's other modules
        (and the first for anything outside the trunk)."""
        prefix = f"{self.trunk.name}." if self.trunk.name else ""
        if not name.startswith(prefix):
            return 0
        inner = name[len(prefix):]
        stack = f"{self.trunk.stack}."
        if inner.startswith(stack):
            return int(inner[len(stack):].split(".")[0]) * self.layout.stages // self.layout.blocks
        _, after = self.trunk.ends(model)
        return self.layout.stages - 1 if any(inner.startswith(f"{path}.") for path in after) else 0

    def prune(self, model: nn.Module) -> None:
        """Remove what this rank's stages do not run; give each stage its own copy of a tied parameter."""
        prune_to_stages(model, self.trunk, self.layout, self.stages)
        untie_across_stages(model, [list(group) for group in self.tied])

    def views(self, model: nn.Module) -> list[StageView]:
        return [StageView(model, self.trunk, self.layout, stage) for stage in self.stages]

    def tied_copies(self, model: nn.Module, pp_ranks_by_coordinate: list[list[int]], rank: int) -> TiedCopies:
        holders = [list(h) for h in self.holders]
        groups = TiedCopies.groups(pp_ranks_by_coordinate, holders)
        pp_ranks = next(ranks for ranks in pp_ranks_by_coordinate if rank in ranks)
        copies = TiedCopies(model, [list(g) for g in self.tied], holders, pp_ranks, groups)
        held = dict(model.named_parameters(remove_duplicate=False))
        for group, embedding in zip(self.tied, self.embeddings):
            for name in group:
                if embedding and name in held:
                    decays_as_embedding(held[name])  # as the shared weight is grouped where it is whole
        return copies
