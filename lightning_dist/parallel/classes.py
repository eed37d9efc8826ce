"""The block classes of a model: named in its config ("package.module.ClassName", one or several) or inferred from
the `nn.ModuleList`s that hold its layers."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable

from torch import nn

from lightning_dist._compat.torch import checkpointed_module, class_before_fully_shard


def resolve_module_class(spec: str | type[nn.Module], key: str) -> type[nn.Module]:
    """Import `spec` if it is a dotted path; fail in one line naming `key` and the classes that do exist there."""
    if isinstance(spec, type):
        if not issubclass(spec, nn.Module):
            raise TypeError(f"{key}: {spec.__qualname__} is not a torch.nn.Module subclass")
        return spec
    module_path, _, class_name = str(spec).rpartition(".")
    if not module_path:
        raise ValueError(f"{key}: {spec!r} is not a dotted class path such as 'mypackage.model.Block'")
    try:
        module = importlib.import_module(module_path)
    except ImportError as error:
        raise ValueError(f"{key}: cannot import module {module_path!r} of {spec!r} ({error})") from None
    found = getattr(module, class_name, None)
    if not (isinstance(found, type) and issubclass(found, nn.Module)):
        choices = sorted(
            name for name, obj in vars(module).items()
            if inspect.isclass(obj) and issubclass(obj, nn.Module) and obj.__module__ == module.__name__
        )
        raise ValueError(
            f"{key}: {spec!r} is not an nn.Module class; classes in {module_path}: {', '.join(choices) or 'none'}"
        )
    return found


BlockClasses = tuple[type[nn.Module], ...]


def resolve_block_classes(spec: str | type[nn.Module] | Iterable[str | type[nn.Module]], key: str) -> BlockClasses:
    """One class (or dotted path), or several: an encoder-decoder model has an encoder layer and a decoder layer."""
    specs = [spec] if isinstance(spec, (str, type)) else list(spec)
    if not specs:
        raise ValueError(f"{key}: an empty list names no block class; name one class or several, or leave it unset")
    return tuple(dict.fromkeys(resolve_module_class(one, key) for one in specs))


def require_classes_in_model(model: nn.Module, classes: BlockClasses, key: str) -> int:
    """Count the instances of `classes` in `model`; a class with none is a configuration error naming the model's."""
    for block_class in classes:
        if not any(isinstance(module, block_class) for module in model.modules()):
            present = sorted({type(module).__name__ for module in model.modules()})
            raise ValueError(
                f"{key}: the model has no {block_class.__qualname__} module; classes in the model: {', '.join(present)}"
            )
    return sum(isinstance(module, classes) for module in model.modules())


def infer_block_classes(model: nn.Module, key: str = "strategy.block_class") -> BlockClasses:
    """The classes of the model's layer stacks: every `nn.ModuleList` of one class is a stack (HF `model.layers`,
    nanoGPT `transformer.h`; an encoder's and a decoder's layers), except lists inside another stack's layers (a T5
    block's sub-layers, a block's experts). () when the model has none.

    A list that mixes classes outside any stack could hold layers of several kinds or parts that are no layers at
    all; rather than guess, a ValueError names its classes and `key`.
    """
    containers = (nn.ModuleList, nn.ModuleDict)  # a list of lists (stages of blocks): its inner lists are the stacks
    lists = [
        m for m in model.modules()
        if isinstance(m, nn.ModuleList) and len(m) and not any(isinstance(child, containers) for child in m)
    ]
    single = {_layer_class(child) for mlist in lists if _one_class(mlist) for child in mlist}
    inside = {
        id(inner) for m in model.modules() if isinstance(m, tuple(single)) for inner in m.modules() if inner is not m
    }
    outer = [mlist for mlist in lists if id(mlist) not in inside]
    mixed = sorted({_layer_class(child).__qualname__ for mlist in outer if not _one_class(mlist) for child in mlist})
    if mixed:
        stacks = sorted({_first_layer_class(mlist).__qualname__ for mlist in outer if _one_class(mlist)})
        raise ValueError(
            f"{key}: cannot infer the model's block class: an nn.ModuleList mixes {', '.join(mixed)}"
            + (f" (single-class stacks: {', '.join(stacks)})" if stacks else "")
            + "; set it to the layer class, or a list of them"
        )
    return tuple(dict.fromkeys(_first_layer_class(mlist) for mlist in outer))


def block_modules(model: nn.Module, classes: BlockClasses = ()) -> list[nn.Module]:
    """The model's blocks, the one definition every part of the package uses (FSDP's units and what activation
    checkpointing wraps, ZeRO-3's live-parameter sizing, the memory planner): the modules of `classes`, or, when none
    are given, of the classes its layer stacks hold (`infer_block_classes`). [] for a model without stacks, or whose
    lists cannot be read as stacks (the strategies refuse those by name; sizing then falls back to the whole model)."""
    if not classes:
        try:
            classes = infer_block_classes(model)
        except ValueError:
            return []
    return [m for m in model.modules() if isinstance(m, classes)] if classes else []


def _one_class(mlist: nn.ModuleList) -> bool:
    return len({_layer_class(child) for child in mlist}) == 1


def _first_layer_class(mlist: nn.ModuleList) -> type[nn.Module]:
    # Not `mlist[0]`: a pipeline stage keeps its layers under their model-wide names ("1" on the second of two), and
    # `trainer.test()` after `fit()` looks for the blocks again in it (a KeyError: '0' there).
    return _layer_class(next(iter(mlist)))


def _layer_class(module: nn.Module) -> type[nn.Module]:
    """The class a layer was built as, under what a strategy has made of it: Lightning sets a strategy up again
    for `trainer.test()` after `fit()`, and by then each block is in a checkpoint wrapper and is an FSDP module
    (FSDP2 swaps in a subclass of the block's own class)."""
    return class_before_fully_shard(checkpointed_module(module))


def block_classes_for(model: nn.Module, configured: BlockClasses, needed_by: Iterable[str] = ()) -> BlockClasses:
    """The configured block classes, each present in `model`, or those inferred from its layer stacks; a model with
    neither is refused, naming its classes, when an option that works block by block (`needed_by`) is on."""
    if configured:
        require_classes_in_model(model, configured, "strategy.block_class")
        return configured
    classes = infer_block_classes(model, "strategy.block_class")
    needed_by = list(needed_by)
    if not classes and needed_by:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"strategy.block_class: {' and '.join(needed_by)} needs the block class and the model has no"
            f" nn.ModuleList to infer it from; set it to one of: {', '.join(present)}"
        )
    return classes
