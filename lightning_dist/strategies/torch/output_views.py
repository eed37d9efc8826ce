"""A sharded module's output that is a view, changed in place before backward: stopped in one line.

FSDP2 (torch 2.13 on) warns on every rank whenever a sharded module's forward returns a view that requires grad,
because an in-place op on that view (`logits += bias`) drops the hook that gathers the module's parameters for
backward, and its gradients can then be wrong. Most such outputs are never changed in place: a language model's
head with a bias returns a view of its 2-D matmul, and the warning then reads like a bug on every run. Here the
warning is silenced and the hazard itself is checked instead: each view a sharded module returns in a training step
is watched, and a step in which one changed in place stops the run, saying which module and what to write instead.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from torch import nn

from lightning_dist._compat.torch import FSDP_VIEW_OUTPUT_WARNING, class_before_fully_shard, is_view, version_of


class OutputViews:
    """The views the sharded modules returned in this training step, with their versions when returned."""

    def __init__(self) -> None:
        self._returned: list[tuple[str, torch.Tensor, int]] = []
        self._watched: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    # A strategy travels by pickle (a dry run's child process, Lightning's spawn launchers) before it has a model:
    # it arrives watching nothing, as it left.
    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def watch(self, modules: list[nn.Module]) -> None:
        """Watch `modules`' outputs from now on, and silence FSDP2's warning about them (this check replaces it)."""
        warnings.filterwarnings("ignore", message=FSDP_VIEW_OUTPUT_WARNING, category=UserWarning)
        for module in modules:
            if module not in self._watched:  # fit, then test: one hook
                module.register_forward_hook(self._record)
                self._watched.add(module)

    def _record(self, module: nn.Module, args: Any, output: Any) -> None:
        if not (torch.is_grad_enabled() and module.training):
            return
        for tensor in _tensors(output):
            if tensor.requires_grad and is_view(tensor):
                self._returned.append((class_before_fully_shard(module).__name__, tensor, version_of(tensor)))

    def check_step(self) -> None:
        """After a training step: raise if a watched view changed in place; forget them either way (the step's
        tensors are not kept past it)."""
        changed = sorted({name for name, tensor, version in self._returned if version_of(tensor) != version})
        self._returned.clear()
        if changed:
            raise RuntimeError(
                f"the output of the FSDP-sharded {' and '.join(changed)} was changed in place in the training step"
                " (an op like `x += y` or `x.div_(t)` on it): FSDP2 then skips gathering its parameters for backward"
                " and its gradients can be wrong; write it out of place (`x = x + y`), or `.clone()` the output first"
            )


def _tensors(output: Any) -> list[torch.Tensor]:
    """The tensors in a module's output: a tensor, or tuples, lists and dicts of them (a transformers ModelOutput is
    a dict)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        return [t for value in output.values() for t in _tensors(value)]
    if isinstance(output, (tuple, list)):
        return [t for value in output for t in _tensors(value)]
    return []
