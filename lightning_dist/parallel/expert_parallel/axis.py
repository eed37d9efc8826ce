"""The expert-parallel axis on one rank: its experts modules split over its group, set up by the strategy, and the
check each step makes that every one of them was reached through its call (a model that used an experts module's
weights without calling it would compute with this rank's experts only: stopped in one line instead)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_dist._compat.peft import parameter_adapters
from lightning_dist.parallel.expert_parallel.layers import (
    CALL,
    KEY,
    experts_modules,
    refusal,
    split_experts,
)


class ExpertParallel:
    """This rank's place on the expert-parallel axis of `mesh` (1-D), with `model`'s experts modules split over it."""

    def __init__(self, model: nn.Module, mesh: Any, rank: int) -> None:
        self.size = mesh.size()
        why = refusal(model, self.size)
        if why is not None:
            raise ValueError(why)
        self.splits = [split_experts(name, module, mesh, rank, parameter_adapters(model, name))
                       for name, module in experts_modules(model)]

    def holds(self, model: nn.Module) -> bool:
        """Whether these are `model`'s experts (a strategy set up again, fit then test, splits nothing twice)."""
        ids = {id(module) for module in model.modules()}
        return all(id(split.module) in ids for split in self.splits)

    @property
    def modules(self) -> list[nn.Module]:
        """The experts modules, which FSDP shards over the ranks left to the experts, each a unit of its own."""
        return [split.module for split in self.splits]

    def run_step(self, strategy: Any, kind: str, run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        for split in self.splits:
            split.calls = 0
        output = run(*args, **kwargs)
        missed = [split.name for split in self.splits if split.calls == 0]
        if missed:
            model = type(strategy.lightning_module).__name__
            raise RuntimeError(f"{KEY}={self.size}: {model}'s {kind} did not call {missed[0]} as {CALL}, so its"
                               " tokens never reached the experts other ranks hold; call the experts module that way")
        return output

    def run_backward(self, strategy: Any, closure_loss: Any, run: Callable[[], Any]) -> Any:
        return run()
