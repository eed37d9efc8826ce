"""A LightningModule's own steps, run by a pipeline schedule.

The schedule runs forward and backward microbatch by microbatch, stage by stage; the user's `training_step` still
says what the loss is and what is logged. Each step is run in three parts:

1. Where the batch enters the model: the user's step runs until it calls the trunk (the module holding the
   blocks), which stops it there and hands over its arguments. The first stage feeds them to the schedule.
2. The loss: on the last stage the schedule's loss function is the user's step on one microbatch, its call of the
   trunk answered with that microbatch's output. What it logs is recorded, not logged. Only the last stage's ranks
   run this part, so a collective in it (`self.all_gather(loss)`) would wait forever for the others: the ones a step
   reaches through Lightning stop the run in one line saying what to write instead.
3. What every rank logs: the last stage averages each logged value over the microbatches and sends them to the
   other stages (the values on the device; the names through the store, only when they change: logged_names.py),
   and every rank logs the same values; a logged torchmetrics object is logged by its name in the
   module on every rank (only the last stage updated it: its sync across ranks adds the others' empty states).

Validation and test run the forward-only schedule (`eval`) the same way.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchmetrics import Metric

from lightning_dist._compat.torch import (
    forward_only_order,
    pipeline_schedule,
    running_order,
    runs_v_schedules,
    tree_map,
)
from lightning_dist.parallel.dims import PIPELINE_PARALLEL
from lightning_dist.parallel.logged_means import is_deferred_mean, mean_over_ranks, means_deferred
from lightning_dist.parallel.pipeline_layout import PipelineLayout, check_pipeline, schedule_named
from lightning_dist.parallel.pipeline_split import (
    PipelineSplit,
    StageView,
    TiedCopies,
    find_trunk,
    hold_stages,
    stage_group,
)
from lightning_dist.strategies.torch.logged_names import LoggedNames
from lightning_dist.strategies.torch.pipeline_idle import IdleClock

_KEY = "strategy.pipeline_parallel_size"


@dataclass(frozen=True)
class PipelineOptions:
    """The strategy's pipeline settings, checked when it is built (each error names its `strategy.` key)."""

    size: int
    schedule: str
    microbatches: int | None
    stages_per_rank: int

    @classmethod
    def of(cls, size: int, schedule: str, microbatches: int | None, stages_per_rank: int) -> PipelineOptions:
        options = cls(size, str(schedule), microbatches, stages_per_rank)
        if size != 1:
            layout = options.layout(blocks=None)
            if layout.style == "v" and not runs_v_schedules():
                raise ValueError(f"strategy.pipeline_schedule={layout.schedule}: torch {torch.__version__} cannot"
                                 " hold two adjacent stages on one rank (its warm-up sends to the rank itself);"
                                 " torch 2.13 or later runs it, or choose Interleaved1F1B")
        return options

    def layout(self, blocks: int | None, batch_size: int | None = None) -> PipelineLayout:
        microbatches = self.microbatches or self.size * self.stages_per_rank
        return check_pipeline(self.size, self.stages_per_rank, self.schedule, microbatches, blocks, batch_size)

    def sharded_block_classes(self, block_classes: tuple[type[nn.Module], ...]) -> tuple[type[nn.Module], ...]:
        """The classes FSDP makes units of: each block, except under a zero-bubble schedule, whose stages are one
        unit each. FSDP's post-backward hook of a block unit fires in the input-gradient pass, before the weight
        gradients it should reduce exist (the weight pass computes them later): measured here, the blocks of a
        ZBVZeroBubble stage then got none or part of their gradients. A stage's root unit is reduced by the
        schedule itself, after every weight pass."""
        if self.size > 1 and schedule_named(self.schedule).zero_bubble:
            return ()
        return block_classes

    def in_flight_share(self) -> float:
        """The share of a batch whose activations the busiest stage (the first) holds at once (the planner's)."""
        if self.size == 1:
            return 1.0
        layout = self.layout(blocks=None)
        return layout.in_flight(self.microbatch_count, 0) / self.microbatch_count

    def receive_buffers(self) -> int:
        """The batch-sized receive buffers the first rank's stages keep (the planner's): each stage but the first
        receives activations, each but the last gradients."""
        if self.size == 1:
            return 0
        layout = self.layout(blocks=None)
        return sum((stage != 0) + (stage != layout.stages - 1) for stage in layout.stages_of_rank(0))

    @property
    def microbatch_count(self) -> int:
        return self.microbatches or self.size * self.stages_per_rank

    def split(self, model: nn.Module, block_classes: tuple[type[nn.Module], ...], pp_rank: int) -> PipelineSplit:
        """How `model` splits into this layout's stages, or ValueError in one line saying what it lacks."""
        if stage_group(model) is not None:  # its blocks would be counted as the stages this rank kept
            raise ValueError(f"{_KEY}={self.size}: this module was split into pipeline stages by an earlier Trainer in"
                             " this process, each rank keeping its stages' blocks alone; go on with that Trainer"
                             " (trainer.test, trainer.predict, trainer.fit), or build the module anew (from a"
                             " checkpoint) for a new one")
        trunk = find_trunk(model, block_classes, _KEY)
        blocks = len(trunk.stack_of(model))
        return PipelineSplit.of(model, trunk, self.layout(blocks), pp_rank)

    def steps(self, strategy: Any, split: PipelineSplit, views: list[Any]) -> PipelineSteps:
        """This rank's stages, scheduled, with their tied copies made equal (after their weights are real)."""
        dims = strategy.parallel_dims
        inner = dims.world_size // dims.pp
        by_coordinate = [[position * inner + rest for position in range(dims.pp)] for rest in range(inner)]
        tied = split.tied_copies(strategy.lightning_module, by_coordinate, strategy.global_rank)
        tied.start_equal()
        pp_group = strategy.device_mesh[PIPELINE_PARALLEL].get_group()
        return PipelineSteps(strategy.lightning_module, split.trunk.of(strategy.lightning_module), views,
                             split.layout, self.microbatch_count, strategy.root_device, pp_group, tied)


class _TrunkCalled(Exception):
    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.args, self.kwargs = args, kwargs


@contextmanager
def _forward_replaced(module: nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    module.forward = forward  # an instance attribute: nn.Module.__call__ finds it
    try:
        yield
    finally:
        del module.forward


def batch_rows(args: tuple, kwargs: dict) -> int:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim():
            return value.shape[0]
    raise ValueError("pipeline parallelism: the model is called with no tensor to split into microbatches")


def tree_sum(output: Any) -> torch.Tensor:
    """The sum of every floating tensor in `output`."""
    leaves: list[torch.Tensor] = []
    tree_map(lambda t: leaves.append(t.float().sum()) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
             output)
    return torch.stack(leaves).sum()


def microbatch(batch: Any, size: int, start: int, stop: int) -> Any:
    """Rows `start:stop` of every tensor in `batch` whose first dimension is the batch's."""
    return tree_map(lambda t: t[start:stop] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == size else t,
                    batch)


def trunk_call(module: nn.Module, trunk: nn.Module, step: Callable[..., Any], batch: Any, *rest: Any
               ) -> tuple[tuple, dict]:
    """What the user's `step` passes to the trunk: the step runs until that call."""
    def stop(*args: Any, **kwargs: Any) -> Any:
        raise _TrunkCalled(args, kwargs)

    with _forward_replaced(trunk, stop):
        try:
            step(batch, *rest)
        except _TrunkCalled as called:
            return called.args, called.kwargs
    raise ValueError(f"pipeline parallelism: {type(module).__name__}.{step.__name__} never calls"
                     f" {type(trunk).__name__}, the module whose blocks the stages run")


@contextmanager
def logs_recorded(module: nn.Module) -> Iterator[list[tuple[str, Any, dict]]]:
    """`module.log` recording what it is given (name, value, options) instead of logging it."""
    records: list[tuple[str, Any, dict]] = []
    module.log = lambda name, value, **kwargs: records.append((name, value, kwargs))  # type: ignore
    try:
        yield records
    finally:
        del module.log


@contextmanager
def collectives_refused(module: Any, step: str, stages: int) -> Iterator[None]:
    """The collectives `module`'s step reaches through Lightning (`self.all_gather`, its strategy's `all_gather`,
    `reduce`, `broadcast` and `barrier`) stop the run in one line instead of waiting for ranks that never join."""
    strategy = module.trainer.strategy

    def refused(name: str) -> Callable[..., Any]:
        def collective(*args: Any, **kwargs: Any) -> Any:
            raise ValueError(f"{_KEY}={stages}: {step} calls {name} after its call of the model, a part of the step"
                             " only the last pipeline stage runs, so the other stages' ranks would never join it; log"
                             " the value instead (self.log(name, value, sync_dist=True)): every stage logs the last"
                             " stage's values")

        return collective

    names = ("all_gather", "reduce", "broadcast", "barrier")
    for name in names:
        setattr(strategy, name, refused(f"self.trainer.strategy.{name}"))
    module.all_gather = refused("self.all_gather")
    try:
        yield
    finally:
        for name in names:
            delattr(strategy, name)
        del module.all_gather


def answered_by(trunk: nn.Module, last: StageView, output: Any) -> AbstractContextManager:
    """The trunk's call answered with the last stage's `output`, as the trunk answers it."""
    return _forward_replaced(trunk, lambda *args, **kwargs: last.answer(output, args, kwargs))


class PipelineSteps:
    """This rank's stages of a pipelined LightningModule, and its steps run through their schedule."""

    def __init__(self, module: nn.Module, trunk: nn.Module, views: list[StageView], layout: PipelineLayout,
                 microbatches: int, device: torch.device, pp_group: Any, tied: TiedCopies) -> None:
        self.module, self.trunk, self.layout, self.microbatches, self.tied = module, trunk, layout, microbatches, tied
        self.views = views
        self.holds_first = any(view.is_first for view in views)
        self.holds_last = any(view.is_last for view in views)
        self.pp_group = pp_group
        hold_stages(module, pp_group)
        self.last_rank = dist.get_global_rank(pp_group, layout.rank_of_stage(layout.stages - 1))
        self.logged_names = LoggedNames(self.last_rank, self.holds_last, dist.get_world_size(pp_group) - 1)
        self._chunks_started, self._next_row = False, 0
        self._step_gradients: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._schedules: dict[tuple[int, bool], tuple[Any, Any, int]] = {}
        if not self.holds_last:
            # The logged metrics of the user's steps are updated on the last stage only; here they take part in
            # their sync with empty states, which torchmetrics would warn of at every epoch's end.
            warnings.filterwarnings("ignore", message=r"The ``compute`` method of metric \w+ was called before")
        self.device = device
        self.idle_clock = IdleClock(device)  # the measured idle share, beside the one the schedule implies
        self.loss_divisor = 1
        self._step: Callable[..., Any] | None = None
        self._batch: Any = None
        self._size = 0
        self._records: list[tuple[torch.Tensor | None, list[tuple[str, Any, dict]]]] = []

    def _schedule_for(self, batch_size: int, train: bool) -> tuple[Any, Any, int]:
        """The schedule over stages set up for training or for held-out passes on batches of `batch_size` rows; for
        a held-out pass on a multi-stage schedule, its forward-only order (a multi-stage schedule's own `eval` runs
        its backward actions too: forward_only_order), else None; and the microbatches it splits a batch into.

        Stages keep what their first step set up: the shapes (a smaller last batch of the held-out set needs its
        own stages), and whether received activations require gradients (torch 2.11's do not learn otherwise after
        a validation ran first: "chunk 0 has gradients None"). A held-out batch that the microbatches do not divide
        (the last one) runs in as many as do: GPipe's forward for a single-stage schedule, which takes any number."""
        key = (batch_size, train)
        if key not in self._schedules:
            from torch.distributed.pipelining import PipelineStage

            layout = self.layout
            stages = [PipelineStage(view, view.stage, layout.stages, self.device, group=self.pp_group)
                      for view in self.views]
            for stage in stages:
                stage.forward_one_chunk = self._marking_chunks(stage.forward_one_chunk)  # type: ignore[method-assign]
                self.idle_clock.watch(stage)
            multi_stage = schedule_named(layout.schedule).multi_stage
            microbatches = self.microbatches if train else max(
                count for count in range(1, self.microbatches + 1) if batch_size % count == 0)
            if train or multi_stage:
                schedule = pipeline_schedule(layout.schedule, stages, self.microbatches, self._loss, multi_stage)
            else:
                schedule = pipeline_schedule("GPipe", stages, microbatches, self._loss, multi_stage=False)
            forward_only = None
            if multi_stage and not train:
                forward_only = forward_only_order(schedule, layout.rank_of_stage, layout.stages, microbatches,
                                                  layout.pp)
            self._schedules[key] = schedule, forward_only, microbatches
        return self._schedules[key]

    # The axis's part in each step (strategies/axis_steps.py): the user's step runs through the schedule instead of
    # the step it is handed, and backward, which the schedule ran microbatch by microbatch, adds its gradients.
    def run_step(self, strategy: Any, kind: str, run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        precision = strategy.precision_plugin
        if kind == "training_step":
            accumulate = strategy.lightning_module.trainer.accumulate_grad_batches
            with precision.train_step_context():
                return self.run(kind, *args, train=True, accumulate=accumulate, **kwargs)
        context = precision.val_step_context if kind == "validation_step" else precision.test_step_context
        with context():
            return self.run(kind, *args, train=False, **kwargs)

    def run_backward(self, strategy: Any, closure_loss: Any, run: Callable[[], Any]) -> Any:
        # Lightning's hooks around backward still run.
        module = strategy.lightning_module
        strategy.pre_backward(closure_loss)
        closure_loss = strategy.precision_plugin.pre_backward(closure_loss, module)
        self.add_step_gradients()
        closure_loss = strategy.precision_plugin.post_backward(closure_loss, module)
        strategy.post_backward(closure_loss)
        return closure_loss

    def run(self, step_name: str, batch: Any, *rest: Any, train: bool, accumulate: int = 1) -> Any:
        """The user's step `step_name` on `batch` through the schedule; what it returns, averaged over the
        microbatches, on every rank (detached: backward has run)."""
        step = getattr(self.module, step_name)
        args, kwargs = self._trunk_inputs(step, batch, *rest)
        self._step, self._batch, self._rest, self._records = step, batch, rest, []
        self._chunks_started, self._next_row = False, 0
        self._size = batch_rows(args, kwargs)
        if train and self._size % self.microbatches:
            raise ValueError(f"strategy.microbatches={self.microbatches}: this batch of {self._size} samples does not"
                             " divide into them; choose a divisor of the batch size")
        self.loss_divisor = self.microbatches * accumulate if train else 1
        schedule, forward_only, microbatches = self._schedule_for(self._size, train)
        inputs = args if self.holds_first else ()
        given = kwargs if self.holds_first else {}
        target = torch.arange(self._size) if self.holds_last else None  # the microbatch's rows, on the host
        if train:
            # Lightning zeroes gradients after `training_step` and before `backward` (at the first batch of each
            # accumulation): the step's gradients are set aside and added in `backward` (`add_step_gradients`),
            # so that each batch's gradients land where Lightning's own backward would have put them.
            params = [param for param in self.module.parameters() if param.requires_grad]
            before = [param.grad for param in params]
            for param in params:
                param.grad = None
            with self.idle_clock.step():
                schedule.step(*inputs, target=target, **given)
            self.tied.sum_gradients()
            self._step_gradients = [(param, param.grad) for param in params]
            for param, grad in zip(params, before):
                param.grad = grad
        else:
            order = running_order(schedule, forward_only, microbatches) if forward_only else nullcontext()
            with torch.no_grad(), order:
                schedule.eval(*inputs, target=target, **given)
            # A stage's root unit keeps its gathered parameters after forward (backward would free them): without a
            # backward, free them here. On torch 2.15 a training step after a held-out pass that left them gathered
            # gave the root's parameters (embeddings, head) no gradients.
            for view in self.views:
                reshard = getattr(view, "reshard", None)
                if callable(reshard):
                    reshard()
        return self._replay_logs()

    def whole_model_groups(self, names: list[list[str]]) -> list[list[str]]:
        """Each optimizer group's parameter names across every stage, in stage order, as the whole model lists
        them (a tied weight once, by its first name). A collective over the pipeline's ranks."""
        everyones: list[Any] = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(everyones, names, group=self.pp_group)
        aliases = self.tied_aliases()
        return [list(dict.fromkeys(name for rank_names in everyones for name in rank_names[index]
                                   if name not in aliases)) for index in range(len(names))]

    def tied_aliases(self) -> dict[str, str]:
        """Each tied weight's other names, mapped to the name the whole model lists it by."""
        return {alias: group[0] for group in self.tied.names for alias in group[1:]}

    @torch.no_grad()
    def add_step_gradients(self) -> None:
        """The last training step's gradients, added where Lightning's backward would have accumulated them."""
        for param, grad in self._step_gradients:
            if grad is not None:
                param.grad = grad if param.grad is None else param.grad.add_(grad)
        self._step_gradients = []

    def _marking_chunks(self, forward_one_chunk: Callable[..., Any]) -> Callable[..., Any]:
        def marked(*args: Any, **kwargs: Any) -> Any:
            self._chunks_started = True
            return forward_one_chunk(*args, **kwargs)

        return marked

    def _trunk_inputs(self, step: Callable[..., Any], batch: Any, *rest: Any) -> tuple[tuple, dict]:
        with logs_recorded(self.module):
            return trunk_call(self.module, self.trunk, step, batch, *rest)

    def _loss(self, output: Any, rows: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function on the last stage: the user's step on microbatch `rows`, its trunk call
        answered with `output`."""
        assert self._step is not None
        if not self._chunks_started:
            # The schedule's first step infers the shapes of gradients from one loss, on a forward of its own
            # before any microbatch: any loss of the output's shape does, and the user's step (its metrics'
            # updates, its logs) must see only the microbatches.
            return tree_sum(output) * 0.0
        # The last stage runs its microbatches in order (every schedule does): the rows follow the previous ones,
        # counted here rather than read from the tensor (a host read on a GPU).
        start = self._next_row
        stop = self._next_row = start + rows.shape[0]
        rows_of_batch = microbatch(self._batch, self._size, start, stop)
        last = next(view for view in self.views if view.is_last)
        with answered_by(self.trunk, last, output), logs_recorded(self.module) as logs, \
                collectives_refused(self.module, self._step.__name__, self.layout.pp), means_deferred(self.module):
            result = self._step(rows_of_batch, *self._rest)
        loss = result.get("loss") if isinstance(result, Mapping) else result
        self._records.append((loss.detach() if isinstance(loss, torch.Tensor) else None, logs))
        if not isinstance(loss, torch.Tensor):
            return torch.zeros((), device=self.device)
        return loss / self.loss_divisor

    def _replay_logs(self) -> Any:
        """The last stage's mean loss and logged values, sent to every stage of the pipeline and logged there."""
        signature, values = self._averaged() if self.holds_last else (None, torch.empty(0))
        names, has_loss, deferred = self.logged_names.exchange(signature)  # on the host: no device read
        values = values.to(self.device) if self.holds_last else torch.empty(len(names) + has_loss, device=self.device)
        dist.broadcast(values, src=self.last_rank, group=self.pp_group)
        if deferred:  # `mean_when_logged`'s, taken now that every stage holds them
            at = torch.tensor([has_loss + position for position in deferred], device=self.device)
            values[at] = mean_over_ranks(values[at])
        for position, (name, metric, kwargs) in enumerate(names):
            value = self.module.get_submodule(metric) if metric is not None else values[has_loss + position]
            self.module.log(name, value, **kwargs)  # type: ignore[operator]
        return values[0] if has_loss else None

    def _averaged(self) -> tuple[tuple[list[tuple[str, str | None, dict]], bool, list[int]], torch.Tensor]:
        losses = [loss for loss, _ in self._records if loss is not None]
        by_name: dict[str, list[Any]] = {}
        kwargs_of: dict[str, dict] = {}
        for _, logs in self._records:
            for name, value, kwargs in logs:
                by_name.setdefault(name, []).append(value)
                kwargs_of[name] = kwargs
        metric_names = {id(m): n for n, m in self.module.named_modules() if isinstance(m, Metric)}
        names, values = [], [torch.stack(losses).float().mean()] if losses else []
        deferred = []
        for name, logged in by_name.items():
            if isinstance(logged[0], Metric):
                # Logged by its name on every stage; its place in the values held, so that every stage's count of
                # them (what it receives) is its count of names.
                names.append((name, metric_names[id(logged[0])], kwargs_of[name]))
                values.append(torch.zeros((), device=self.device))
                continue
            if any(is_deferred_mean(value) for value in logged):
                deferred.append(len(names))
            names.append((name, None, kwargs_of[name]))
            values.append(torch.stack([torch.as_tensor(v, dtype=torch.float32).to(self.device) for v in logged]).mean())
        stacked = torch.stack(values) if values else torch.empty(0, device=self.device)
        # What the other stages wait for: gloo takes a shorter broadcast without a word, NCCL waits for the rest.
        assert stacked.numel() == len(names) + bool(losses), (len(names), bool(losses), stacked.numel())
        return (names, bool(losses), deferred), stacked
