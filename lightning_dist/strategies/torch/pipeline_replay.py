"""The dry run's replay of one rank's pipeline stages (`dry_run=true` with pipeline stages): the stages the strategy
set up (pruned, sharded per stage), stepped on fake tensors in the order their schedule runs them on this rank.

Nothing is sent, so nothing waits: each action runs in the schedule's order, and what a stage holds is what the
schedule makes it hold. A forward keeps its microbatch's graph until that microbatch's backward (GPipe: all of them;
1F1B: as many as the stages after it, its warm-up); the buffers torch's stages keep from their first step, one per
microbatch, receive the activations from the stage before and the gradients from the stage after; under FSDP a
stage stays gathered, its gradients unreduced, from its first backward to the step's end, when the schedule reduces
them (`stage_reduce_gradients`). The last stage's loss is the user's `training_step` on its microbatch, the model's
call answered with the stage's output, as in training (pipeline.py).

The order: 1F1B's and GPipe's as torch's single-stage schedules run them; a multi-stage schedule's own actions
(`rank_actions`). Zero-bubble schedules split backward in two passes, which this replay does not: they are refused
(pipeline_layout.dry_run_refusal).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_dist._compat.torch import (
    pipeline_schedule,
    rank_actions,
    stage_backward,
    stage_reduce_gradients,
    tree_map,
)
from lightning_dist.parallel.dims import PIPELINE_PARALLEL
from lightning_dist.parallel.pipeline_layout import PipelineLayout, schedule_named
from lightning_dist.parallel.pipeline_split import StageView
from lightning_dist.strategies.torch.pipeline import (
    answered_by,
    batch_rows,
    logs_recorded,
    microbatch,
    trunk_call,
)

Action = tuple[int, str, int]  # stage, "F" or "B", microbatch


def single_stage_order(schedule: str, stage: int, stages: int, microbatches: int) -> list[Action]:
    """The order torch's single-stage schedules run: GPipe every forward, then every backward; 1F1B as many forwards
    as there are stages from this one to the last (its warm-up), then one backward and one forward in turn."""
    if schedule == "GPipe":
        return [(stage, "F", m) for m in range(microbatches)] + [(stage, "B", m) for m in range(microbatches)]
    warmup = min(microbatches, stages - stage)
    order: list[Action] = [(stage, "F", m) for m in range(warmup)]
    for backward in range(microbatches):
        order.append((stage, "B", backward))
        if warmup + backward < microbatches:
            order.append((stage, "F", warmup + backward))
    return order


def stage_boundary(whole: Any, trunk: Any, layout: PipelineLayout, batch: Any) -> torch.Size:
    """The shape of what one stage hands the next, for `batch`: the first stage's output, run on the meta device
    from `whole` (the model built on meta, not pruned)."""
    first = StageView(whole, trunk, layout, 0)
    with logs_recorded(whole):
        args, kwargs = trunk_call(whole, trunk.of(whole), whole.training_step, batch, 0)
    on_meta = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, (args, kwargs))
    with torch.no_grad():
        output = first(*on_meta[0], **on_meta[1])
    return output.shape


class PipelineReplay:
    """This rank's stages (`views`) of `module`, with the buffers their schedule keeps and its order of actions."""

    def __init__(self, strategy: Any, module: Any, views: list[StageView], batch: Any,
                 boundary: torch.Size, dtype: torch.dtype) -> None:
        from torch.distributed.pipelining import PipelineStage

        split = strategy.pipeline_split
        layout, options = split.layout, strategy.pipeline
        self.module, self.trunk = module, split.trunk.of(module)
        self.microbatches = options.microbatch_count
        device, group = strategy.root_device, strategy.device_mesh[PIPELINE_PARALLEL].get_group()
        self.stages = {view.stage: PipelineStage(view, view.stage, layout.stages, device, group=group)
                       for view in views}
        self.views = {view.stage: view for view in views}
        args, kwargs = trunk_call(module, self.trunk, module.training_step, batch, 0)
        size = batch_rows(args, kwargs)
        rows = size // self.microbatches
        spans = [(m * rows, (m + 1) * rows) for m in range(self.microbatches)]
        self.inputs = [(microbatch(args, size, *span), microbatch(kwargs, size, *span)) for span in spans]
        self.batches = [microbatch(batch, size, *span) for span in spans]
        shape = (rows, *boundary[1:])

        def buffers() -> list[torch.Tensor]:
            return [torch.empty(shape, dtype=dtype, device=device, requires_grad=True) for _ in spans]

        self.received = {stage: buffers() for stage in self.stages if stage != 0}
        self.gradients = {stage: buffers() for stage in self.stages if stage != layout.stages - 1}
        if schedule_named(layout.schedule).multi_stage:
            schedule = pipeline_schedule(layout.schedule, list(self.stages.values()), self.microbatches,
                                         lambda output, target: output, multi_stage=True)
            pp_rank = layout.rank_of_stage(next(iter(self.stages)))
            self.order = rank_actions(schedule, pp_rank)
        else:
            self.order = single_stage_order(layout.schedule, next(iter(self.stages)), layout.stages,
                                            self.microbatches)

    def buffers(self) -> list[torch.Tensor]:
        """The receive buffers the stages keep between steps."""
        return [buffer for held in (*self.received.values(), *self.gradients.values()) for buffer in held]

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """One training step of this rank's stages in their schedule's order, then the optimizer's step."""
        optimizer.zero_grad()
        held: dict[tuple[int, int], tuple[Any, tuple]] = {}
        for stage, kind, m in self.order:
            view = self.views[stage]
            if kind == "F":
                inputs: tuple = () if view.is_first else (self.received[stage][m],)
                args, kwargs = self.inputs[m] if view.is_first else (inputs, {})
                output = view(*args, **kwargs)
                held[(stage, m)] = (self._loss(view, output, m) if view.is_last else (output,)), inputs
                continue
            output, inputs = held.pop((stage, m))
            grads = None if view.is_last else (self.gradients[stage][m],)
            stage_backward(self.stages[stage], output, grads, inputs)
            for sent in inputs:
                sent.grad = None  # sent to the stage before, and dropped
        for pipeline_stage in self.stages.values():
            stage_reduce_gradients(pipeline_stage)
        optimizer.step()

    def _loss(self, view: StageView, output: Any, m: int) -> torch.Tensor:
        with answered_by(self.trunk, view, output), logs_recorded(self.module):
            result = self.module.training_step(self.batches[m], 0)
        loss = result["loss"] if isinstance(result, Mapping) else result
        return loss / self.microbatches
