"""Resolving the block class a model names in its config ("package.module.ClassName") to the class itself."""

from __future__ import annotations

import importlib
import inspect

from torch import nn


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
        raise ValueError(f"{key}: {spec!r} is not an nn.Module class; classes in {module_path}: {', '.join(choices) or 'none'}")
    return found


def require_class_in_model(model: nn.Module, block_class: type[nn.Module], key: str) -> int:
    """Count the instances of `block_class` in `model`; zero is a configuration error naming the model's classes."""
    count = sum(isinstance(module, block_class) for module in model.modules())
    if count == 0:
        present = sorted({type(module).__name__ for module in model.modules()})
        raise ValueError(
            f"{key}: the model has no {block_class.__qualname__} module; classes in the model: {', '.join(present)}"
        )
    return count


def infer_block_class(model: nn.Module) -> type[nn.Module] | None:
    """The class of the repeated layers, when the model keeps them in `nn.ModuleList`s of a single class.

    This is how transformer implementations hold their layers (HF `model.layers`, nanoGPT `transformer.h`), so it
    finds the block without configuration; None when there is no such list or the lists mix classes.
    """
    classes = {type(child) for module in model.modules() if isinstance(module, nn.ModuleList) for child in module}
    return classes.pop() if len(classes) == 1 else None
