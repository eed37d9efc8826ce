"""Regional compilation: each block of the model compiled on its own (torch.compile of the repeated layer, the way
torchtitan and Accelerate do it), so identical blocks share one compiled graph and the whole model is never traced.

Order (torchtitan's): activation checkpointing wraps a block, the wrapper is compiled, then FSDP or ZeRO wraps the
model. `nn.Module.compile()` compiles in place, so parameter names and checkpoint keys stay those of the eager model
(no `_orig_mod.`): a compiled run resumes an eager run's checkpoint and back.

An engine whose hooks around a block the compiler cannot trace (ZeRO-3's parameter gathers, which DeepSpeed marks
not to be compiled) has the block's forward alone compiled (`hooks_outside`): its hooks then run around the
compiled code rather than splitting it into a graph per submodule.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from torch import nn

from lightning_dist._compat.lightning import StrategyMixin
from lightning_dist._compat.torch import (
    CheckpointWrapper,
    compilation_events,
    compile_forward,
    eager,
    inductor_cache_dir,
    is_compiled,
    wrapped_module,
)
from lightning_dist.parallel.classes import BlockClasses

log = logging.getLogger(__name__)


def compile_blocks(model: nn.Module, block_classes: BlockClasses, hooks_outside: bool = False,
                   device_type: str | None = None) -> int:
    """Compile every block of `block_classes` in `model` (its activation-checkpoint wrapper if it has one), in
    place; idempotent (Lightning sets a strategy up again for `test` after `fit`). `hooks_outside`: the block's
    forward alone, for an engine's hooks the compiler cannot trace. `device_type`: where they will run (a CPU gains
    little, and is told so). Returns the number compiled."""
    blocks = block_runners(model, block_classes)
    for block in blocks:
        if not is_compiled(block):
            compile_forward(block) if hooks_outside else block.compile()
    CLOCK.start_timing()
    names = ", ".join(sorted({cls.__name__ for cls in block_classes}))
    log.info("torch.compile: %d blocks (%s) compile on their first forward and backward, so the first step takes "
             "longer; inductor's cache, which later runs reuse: %s", len(blocks), names, inductor_cache_dir())
    if device_type == "cpu":
        log.info("compile=true on a CPU: expect little or no gain; inductor fuses the element-wise ops around the "
                 "matrix products, which take most of a CPU's step (BENCHMARKS.md, Regional compilation)")
    return len(blocks)


def block_runners(model: nn.Module, block_classes: BlockClasses) -> list[nn.Module]:
    """The module that runs each block: its activation-checkpoint wrapper where it has one (compiling the wrapper
    lets the compiler see the recomputation), else the block itself."""
    wrappers = [m for m in model.modules()
                if isinstance(m, CheckpointWrapper) and isinstance(wrapped_module(m), block_classes)]
    wrapped = {id(wrapped_module(w)) for w in wrappers}
    return wrappers + [m for m in model.modules() if isinstance(m, block_classes) and id(m) not in wrapped]


class CompilationClock:
    """Seconds spent compiling, and graphs compiled, since the last report. A block split by hooks the compiler
    cannot trace (ZeRO-3 gathers each layer's parameters in one) compiles as dozens of small graphs: they are
    reported together, once a step has run, rather than one line each."""

    def __init__(self) -> None:
        self.graphs, self.seconds = 0, 0.0
        self._started: float | None = None
        self._timing = False

    def start_timing(self) -> None:
        if not self._timing:
            self._timing = True
            compilation_events(self._begin, self._end)

    def _begin(self) -> None:
        self._started = time.perf_counter()

    def _end(self) -> None:
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self.graphs += 1
            self._started = None

    def report(self) -> None:
        """Log what was compiled since the last report, if anything, and start counting again."""
        if self.graphs:
            log.info("torch.compile: compiled %d graph%s in %.1f s", self.graphs, "s" * (self.graphs > 1), self.seconds)
            self.graphs, self.seconds = 0, 0.0


CLOCK = CompilationClock()


class ReportsCompilation(StrategyMixin):
    """Strategy mixin: at the start of each training step, says what the steps and validation before it compiled
    and how long that took (once after the first step, as a rule; again only if something compiled since).

    Lightning's sanity check (a few validation batches before training) runs eager: compiled, it would compile each
    block's graph for no-grad first, and training's with gradients after it, as a recompilation (a second graph per
    block, and a recompile the raw compiled loop never has)."""

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.lightning_module.trainer.sanity_checking:  # type: ignore[union-attr]  # set up: a module is there
            with eager():
                return super().validation_step(*args, **kwargs)
        return super().validation_step(*args, **kwargs)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        CLOCK.report()
        super().on_train_batch_start(batch, batch_idx)

    def on_train_end(self) -> None:
        CLOCK.report()
        super().on_train_end()
