"""What every strategy of ours shares, and what the rest of the package may ask of one.

Each strategy is its engine's Lightning strategy under `StrategyBase`: the mixins in their one order, the launcher
guard, the rank prologue, the block options, the sampler's arguments and the process-group backend. The rest of the
package (the planner, the dry run, the job) asks a strategy through the protocol below and never switches on its type:

- `parallel_dims`: the named parallel axes and their sizes (parallel/dims.py);
- `memory_layout(name)`: the planner's terms for what is sharded and offloaded (memory/layout.py);
- `precision_support`: what it trains in beyond the defaults (parallel/precision.py);
- `initializes_shards`: the model is built without weights and each rank initialises its own shards;
- `keeps_state_on_host`: offloaded state, whose collectives need gloo beside nccl;
- `offload_targets()`: where the running engine keeps optimizer state and parameters, read back from it;
- `gradient_norm_scope()`: the ranks the model's gradient norm spans beyond this one's part (pipeline stages);
- `pipeline_bubble`: the idle share of a step its pipeline schedule implies, and `pipeline_idle` the clock that
  measures this rank's (strategies/torch/pipeline_idle.py); the training monitor logs both;
- `checks_nonfinite_on_device(checked)`: the run stops on a non-finite loss or gradient norm by itself (the training
  monitor), so the engine need not read its gradient norm on the host every step to skip such a step;
- `dry_run_refusal`, `dry_run_rank(...)` and `dry_run_patches()`: whether the dry run knows it, one rank of it, and
  what its engine needs replaced on fake tensors (dry_run/);
- `checkpoint_tensor_parallel`: the AutoTP size whose DeepSpeed checkpoints it reads as they are, or None.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from torch import nn
from typing_extensions import override

from lightning_dist._compat.lightning import (
    broadcast_sigterm_at_logging_steps,
    epoch_label_without_a_negative_total,
    lightning_grad_norm_runs,
    read_bar_values_at_refresh,
)
from lightning_dist.checkpoints.background import BackgroundSaves
from lightning_dist.checkpoints.formats import check_fit_ckpt_path
from lightning_dist.checkpoints.frozen_weights import LeavesFrozenWeightsOut
from lightning_dist.checkpoints.logged_steps import LogsGlobalSteps
from lightning_dist.checkpoints.swap import SwappedSaves
from lightning_dist.data.train_loader_place import ContinuesTrainLoaders
from lightning_dist.lifecycle.collective_timeout import forming_process_group
from lightning_dist.parallel.activation_checkpoint import CheckpointPlan
from lightning_dist.parallel.block_options import BlockOptions
from lightning_dist.parallel.devices import prepare_rank, process_group_backend, process_group_timeout
from lightning_dist.parallel.parameter_grad_norms import grad_norm, run_ended, running_under
from lightning_dist.parallel.precision import PrecisionSupport, say_upcast, upcast_trainable_weights
from lightning_dist.parallel.quantized import QuantizedSupport, check_quantized_weights, keep_quantized_layout
from lightning_dist.parallel.regional_compile import ReportsCompilation
from lightning_dist.parallel.sharded_init import ForgetsUnbuiltModel
from lightning_dist.strategies.axis_steps import StepsThroughAxes
from lightning_dist.strategies.launcher import guarded
from lightning_dist.strategies.trainable_set import TrainableSet, refuse_finetuning_callbacks
from lightning_dist.strategies.weight_averaging import refuse_weight_averaging

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule

    from lightning_dist.dry_run.ranks import RankView
    from lightning_dist.memory.layout import Layout
    from lightning_dist.parallel.dims import ParallelDims


class StrategyBase(ReportsCompilation, ContinuesTrainLoaders, LeavesFrozenWeightsOut, BackgroundSaves, SwappedSaves,
                   LogsGlobalSteps, ForgetsUnbuiltModel, StepsThroughAxes):
    """The base of every strategy of ours, before its engine's Lightning strategy in the bases.

    The mixins' hooks call on through `super()`, so their order is how they nest around Lightning's strategy: compile
    reports outermost; a resumed run's train loaders go on where it stopped, and each save records what they read
    (data/train_loader_place.py); background saves hand their write to swapped saves, which put it in place whole;
    the logged rows' step labels; a model never built is forgotten at teardown; each step runs through the parallel
    axes that act on it (`step_axes()`), around Lightning's own. tests/strategies/test_base_order.py pins it.
    """

    precision_support = PrecisionSupport()
    dry_run_refusal: str | None = None  # why the dry run cannot replay this strategy (as configured), or None
    strategy_name: str  # its name in Lightning's registry (ld_ddp, ld_fsdp, ld_deepspeed)
    checkpoint_tensor_parallel: int | None = None

    def __init__(
        self,
        *args: Any,
        block_class: Any = None,
        activation_checkpointing: bool | str | int = False,
        compile: bool = False,
        async_checkpoint: bool = False,
        timeout: timedelta | float | None = None,
        exclude_frozen_parameters: bool = False,
        **kwargs: Any,
    ) -> None:
        # The options are checked, each naming its `strategy.` key, before Lightning's strategy is built.
        self.blocks = BlockOptions.of(block_class, activation_checkpointing, compile)
        self.async_checkpoint = async_checkpoint
        super().__init__(*args, timeout=process_group_timeout(timeout), **kwargs)
        self.exclude_frozen_parameters = exclude_frozen_parameters  # after Lightning's DeepSpeed set its own default

    # The protocol's parts that each engine's strategy declares.
    @property
    def parallel_dims(self) -> ParallelDims:
        raise NotImplementedError

    def memory_layout(self, name: str) -> Layout:
        raise NotImplementedError

    def dry_run_rank(self, build: Callable[[], nn.Module], batch: Any, precision: str, devices: int, num_nodes: int,
                     rank: int, device_type: str) -> RankView:
        """Rank `rank` of `devices` x `num_nodes`, set up by this strategy on fake `device_type` devices and trained
        two steps on `batch` (dry_run/ranks.py)."""
        raise NotImplementedError

    def model_refusal(self, model: nn.Module, parallel_dims: ParallelDims) -> str | None:
        """Why this strategy, at `parallel_dims`, cannot run `model` (built on the meta device), in the words its
        launch would refuse it with; None when it can. `plan=true` marks such presets in its table."""
        return None

    def dry_run_patches(self) -> AbstractContextManager:
        """What the engine needs replaced to run Lightning's loop on fake tensors (dry_run/fake_loop.py)."""
        return nullcontext()

    @property
    def keeps_state_on_host(self) -> bool:
        return False

    @property
    def initializes_shards(self) -> bool:
        return False

    def offload_targets(self) -> dict[str, str | None]:
        """Where the running engine keeps optimizer state and parameters (None: on the device), read back from the
        engine rather than from our options, so that it shows what the engine really does."""
        return {"optimizer": None, "parameters": None}

    pipeline_bubble: float | None = None  # the idle share of a step the pipeline schedule implies; None: no stages
    pipeline_idle: Any = None  # the IdleClock timing this rank's stages, under pipeline stages

    def gradient_norm_scope(self) -> tuple[Any, set[int]]:
        """Where the model's gradient norm is whole: a process group whose ranks hold other parts of the model
        (pipeline stages) to combine the local norms over, or None; and the ids of parameters whose gradient is
        counted on another rank (a tied weight's copies)."""
        return None, set()

    def checks_nonfinite_on_device(self, checked: bool) -> None:
        """Told by the training monitor while it stops the run at a non-finite value (checked on the device, read at
        its checks): an engine that skips such steps by reading its gradient norm on the host every step (ZeRO) may
        leave that to it. Our other engines read nothing."""

    if TYPE_CHECKING:
        # Lightning types these as optional, for a strategy not yet connected; ours read them only once it is.
        @property
        def lightning_module(self) -> LightningModule: ...

        @property
        def model(self) -> nn.Module: ...

        @model.setter
        def model(self, model: nn.Module) -> None: ...

    @property
    def activation_checkpointing(self) -> CheckpointPlan | None:
        return self.blocks.checkpointing

    _trainable: TrainableSet | None = None  # which parameters train, from the fit's start

    @override
    def on_train_start(self) -> None:
        # No host reads in a step that does not log: the bar's values (whichever bar), Lightning's SIGTERM agreement.
        trainer = self.lightning_module.trainer
        read_bar_values_at_refresh(trainer)
        broadcast_sigterm_at_logging_steps(trainer)
        epoch_label_without_a_negative_total(trainer)
        # A module's `grad_norm(self, 2)` (Lightning's) reads the whole gradients this strategy shards or holds.
        running_under(self)
        lightning_grad_norm_runs(grad_norm)
        self._trainable = TrainableSet(self.lightning_module)
        super().on_train_start()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._trainable is not None and self._trainable.changed(module := self.lightning_module):
            if self.trainable_change_refusal is not None:
                raise RuntimeError(self._trainable.refusal(module, self.strategy_name, self.trainable_change_refusal))
            self.follow_trainable_change()
            self._trainable = TrainableSet(module)
        super().on_train_batch_start(batch, batch_idx)

    @property
    def trainable_change_refusal(self) -> str | None:
        """Why this engine cannot follow a change of the trainable parameters during a fit, or None
        (strategies/trainable_set.py)."""
        return None

    def follow_trainable_change(self) -> None:
        """On every rank, before the batch's step: set the engine up for the parameters that train now."""

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        self._launcher = guarded(self, self._launcher, self._before_launch)

    def _before_launch(self, trainer: Any, fit_arguments: dict[str, Any]) -> None:
        check_fit_ckpt_path(fit_arguments.get("ckpt_path"))  # each rank would fail reading it, one traceback each
        model = fit_arguments.get("model")
        if isinstance(model, nn.Module):
            self.check_quantized_weights(model)  # a model built in `__init__`
        refuse_weight_averaging(trainer, self.strategy_name, self.weight_averaging_refusal)
        refuse_finetuning_callbacks(trainer, self.strategy_name, self.trainable_change_refusal)
        self.preflight(trainer, fit_arguments)

    @override
    def setup(self, trainer: Any) -> None:
        self.hold_weights(self.lightning_module)  # a model built in `configure_model`
        super().setup(trainer)

    @override
    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            lightning_grad_norm_runs(None)
            run_ended()

    def hold_weights(self, model: nn.Module) -> None:
        """On each rank, before the engine wraps the model: a quantized base kept as bitsandbytes made it, and fp32
        weights for the optimizer where the precision promises them, whatever dtype the model was loaded in."""
        self.hold_quantized_weights(model)
        if self.precision_support.casts_weights:
            return
        precision = str(getattr(self.precision_plugin, "precision", ""))
        say_upcast(precision, upcast_trainable_weights(model, precision))

    def check_quantized_weights(self, model: nn.Module) -> None:
        """A quantized base (QLoRA's) only where this strategy keeps it as bitsandbytes made it (quantized.py)."""
        check_quantized_weights(model, self.strategy_name, self.quantized_support,
                                getattr(self.precision_plugin, "precision", None))

    def hold_quantized_weights(self, model: nn.Module) -> None:
        """On each rank, as it sets the model up: the check, then each 4-bit weight kept in its layout."""
        self.check_quantized_weights(model)
        keep_quantized_layout(model, sharded=self.quantized_support.shards)

    @property
    def quantized_support(self) -> QuantizedSupport:
        """How this strategy, as configured, holds a quantized base; each engine's says."""
        return QuantizedSupport(refusal="which this strategy would shard or cast as numbers and train silently wrong"
                                        " (accelerate #3983); train a quantized base under ld_ddp")

    def weight_averaging_refusal(self, callback: Any) -> str | None:
        """Why Lightning's weight-averaging `callback` cannot run under this strategy, ending in what to do instead
        (strategies/weight_averaging.py), or None where every rank holds the whole weights and saves Lightning's
        checkpoint."""
        return None

    def preflight(self, trainer: Any, fit_arguments: dict[str, Any]) -> None:
        """On the launching process, before any rank starts: a model to checkpoint or compile block by block must
        have blocks. Each strategy adds its own checks."""
        model = fit_arguments.get("model")
        if self.blocks.needed_by and isinstance(model, nn.Module) and next(model.parameters(), None) is not None:
            self.blocks.classes_in(model)

    @contextmanager
    def forming_process_group(self) -> Iterator[None]:
        """The rank's prologue: its device, cores and timeouts set (prepare_rank), then, inside, its process group
        formed, a rank that never joins named (lifecycle/collective_timeout.py)."""
        timeout = process_group_timeout(self._timeout)  # as `__init__` set it
        prepare_rank(self.root_device, self.num_processes, timeout)
        with forming_process_group(timeout, lambda: self.global_rank):
            yield

    @override
    def _get_process_group_backend(self) -> str:
        # Offloaded state is host tensors: their gradient-norm, clipping and gather collectives need gloo.
        return self._process_group_backend or process_group_backend(self.root_device, self.keeps_state_on_host)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return self.parallel_dims.sampler_kwargs(self.global_rank)
