"""FSDP2 (`fully_shard`) without a `configure_model` hook: the strategy shards the model by its block class."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_dist._compat.lightning import attached_trainer, give_device_mesh, move_optimizers_to_device
from lightning_dist._compat.torch import checkpoint_loads_in_one_process, fully_sharded_parameters, fully_sharded_units
from lightning_dist.checkpoints.compiled_names import load_saved_names_into_compiled_parts
from lightning_dist.checkpoints.contents import left_frozen_weights_out
from lightning_dist.checkpoints.formats import CURRENT_MODEL_STATE, DISTRIBUTED
from lightning_dist.checkpoints.resume import (
    drop_group_keys_not_saved,
    load_for_resume,
    load_weights_from_rank_zero,
    restore_optimizer_by_name,
)
from lightning_dist.checkpoints.save_pretrained import refuse_own_save_pretrained
from lightning_dist.checkpoints.source import CheckpointSource, weights_only_for
from lightning_dist.checkpoints.swap import write_then_swap
from lightning_dist.memory.layout import Layout
from lightning_dist.optim import require_shardable_optimizer
from lightning_dist.parallel.classes import BlockClasses
from lightning_dist.parallel.context_parallel import (
    ContextParallel,
    check_context_parallel,
    context_parallel_of,
    context_refusal,
)
from lightning_dist.parallel.dims import CONTEXT_PARALLEL, TENSOR_PARALLEL, ParallelDims, sharding_layout
from lightning_dist.parallel.expert_parallel import ExpertParallel
from lightning_dist.parallel.expert_parallel import refusal as experts_refusal
from lightning_dist.parallel.grad_norm import check_placements, clip_grad_norm_
from lightning_dist.parallel.module_state import move_module_state
from lightning_dist.parallel.pipeline_layout import dry_run_refusal as pipeline_dry_run_refusal
from lightning_dist.parallel.pipeline_split import PipelineSplit
from lightning_dist.parallel.pipeline_transformers import router_loss_refusal
from lightning_dist.parallel.precision import PrecisionSupport
from lightning_dist.parallel.quantized import QuantizedSupport, data_parallel_support
from lightning_dist.parallel.sharded_init import has_meta_parameters, parameters_on_meta
from lightning_dist.parallel.sizes import DEFAULT_SIZES, ParallelSizes
from lightning_dist.parallel.tensor_parallel import (
    TensorParallelPlan,
    apply_tensor_parallel,
    check_plan,
    resolve_plan,
)
from lightning_dist.strategies.axis_steps import StepAxis
from lightning_dist.strategies.base import StrategyBase
from lightning_dist.strategies.refusals import frozen_left_out_refusal
from lightning_dist.strategies.torch.fully_shard import (
    apply_fully_shard,
    materialize_shards,
    mixed_precision_policy,
    offload_policy,
    shard_device,
)
from lightning_dist.strategies.torch.output_views import OutputViews
from lightning_dist.strategies.torch.pipeline import PipelineOptions, PipelineSteps
from lightning_dist.strategies.torch.pipeline_idle import IdleClock
from lightning_dist.strategies.torch.replay import ReplayedOnTorch
from lightning_dist.strategies.torch.sharded_average import (
    ShardedAverages,
    gathered_average,
    read_current_weights,
    sharded_weights,
)
from lightning_dist.strategies.tuner import refuse_learning_rate_finder
from lightning_dist.strategies.weight_averaging import saved_with_an_average

# LightningModule methods that run the model without going through `forward`.
_STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


class FSDPStrategy(ReplayedOnTorch, StrategyBase, ModelParallelStrategy):
    """Fully Sharded Data Parallel (FSDP2) on CPU (gloo) or CUDA (nccl).

    Args:
        sharding_strategy: FULL_SHARD (ZeRO-3 like), SHARD_GRAD_OP (ZeRO-2 like) or HYBRID_SHARD (shard within a
            node, replicate across nodes).
        block_class: the repeated layer (class or dotted path, or a list of them: an encoder's and a decoder's) that
            becomes one FSDP unit each, and what activation checkpointing wraps. Unset: the classes of the model's
            layer stacks (`nn.ModuleList`s of one class).
        activation_checkpointing: recompute activations in backward: true (every block), "ops" (every block,
            keeping the outputs of its matrix products and attention), or an integer k (every k-th block).
        cpu_offload: keep sharded parameters, gradients and optimizer state in host memory.
        save_distributed_checkpoint: each rank writes its shard (a checkpoint directory); False gathers one file.
        tensor_parallel_size: ranks of one tensor-parallel group, which split each planned layer (within a node);
            FSDP shards over the data-parallel ranks that are left. 1: no tensor parallelism.
        data_parallel_replicate_size: groups that replicate the sharded state (HSDP); unset: the number of nodes
            under HYBRID_SHARD, else 1. One of the two sizes may be -1, the ranks that are left.
        tensor_parallel_plan: module-name patterns mapped to "colwise" or "rowwise"; unset: the model's own
            (`tp_plan`, parallel/tensor_parallel.py).
        compile: compile each block with torch.compile (regional compilation), after activation checkpointing and
            before sharding.
        async_checkpoint: write checkpoints in the background: the step waits only while each rank copies its
            shards to host memory.
        process_group_backend: "gloo", "nccl" or per device type ("cpu:gloo,cuda:nccl"); unset: chosen from the
            accelerator and where the state lives.
        timeout: how long a collective waits for the other ranks (seconds or a timedelta) before the run fails.
        pipeline_parallel_size: pipeline stages the model's blocks are split into, on ranks outermost in the mesh
            (each rank builds only its stage's weights); FSDP and tensor parallelism run inside each stage. 1: none.
        pipeline_schedule: torch's schedule by name (GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
            ZBVZeroBubble, DualPipeV) or a schedule's .csv file.
        microbatches: how many parts each rank's batch is split into for the schedule; unset: one per stage.
        stages_per_rank: stages each pipeline rank holds (virtual stages, for interleaved and V schedules).
        context_parallel_size: ranks that split each sequence (each holds a contiguous shard, from the embedding to
            the loss); FSDP shards over the data and context ranks together. 1: none.
        context_parallel: how attention sees the whole sequence: "all_to_all" (Ulysses: heads exchanged for the
            sequence around attention; the heads must divide by the size) or "ring" (torch's ring attention, CUDA only:
            its SDPA kernels; each rank keeps every head).
        expert_parallel_size: ranks, among those FSDP shards over, that split each mixture-of-experts layer's
            experts (each holds experts / size; tokens go to their experts and back by all-to-all); the experts are
            sharded over the ranks left to them (parallel/expert_parallel). 1: none.
        exclude_frozen_parameters: checkpoints leave the frozen weights out (a LoRA run's base) and record each
            one's fingerprint; a resume takes them from the model it builds once those match
            (checkpoints/frozen_weights.py).
    """

    strategy_name = "ld_fsdp"

    def __init__(
        self,
        sharding_strategy: str = "FULL_SHARD",
        block_class: str | type[nn.Module] | Sequence[str | type[nn.Module]] | None = None,
        activation_checkpointing: bool | str | int = False,
        cpu_offload: bool = False,
        save_distributed_checkpoint: bool = True,
        tensor_parallel_size: int = DEFAULT_SIZES.tensor,
        data_parallel_replicate_size: int | None = DEFAULT_SIZES.replicate,
        tensor_parallel_plan: dict[str, str] | None = None,
        compile: bool = False,
        async_checkpoint: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        pipeline_parallel_size: int = DEFAULT_SIZES.pipeline,
        pipeline_schedule: str = "1F1B",
        microbatches: int | None = None,
        stages_per_rank: int = 1,
        context_parallel_size: int = DEFAULT_SIZES.context,
        context_parallel: str = "all_to_all",
        expert_parallel_size: int = DEFAULT_SIZES.expert,
        exclude_frozen_parameters: bool = False,
    ) -> None:
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint, process_group_backend=process_group_backend,
            timeout=timeout, block_class=block_class, activation_checkpointing=activation_checkpointing,
            compile=compile, async_checkpoint=async_checkpoint, exclude_frozen_parameters=exclude_frozen_parameters,
        )
        if refusal := frozen_left_out_refusal(exclude_frozen_parameters, pipeline_parallel_size=pipeline_parallel_size,
                                              expert_parallel_size=expert_parallel_size):
            raise ValueError(refusal)
        self.reshard_after_forward, self.hybrid = sharding_layout(sharding_strategy)
        self.sharding_strategy = str(sharding_strategy).upper()
        self.cpu_offload = cpu_offload
        self.tensor_parallel_size = tensor_parallel_size
        self.data_parallel_replicate_size = data_parallel_replicate_size
        self.tensor_parallel_plan = None if tensor_parallel_plan is None else check_plan(
            dict(tensor_parallel_plan), "strategy.tensor_parallel_plan")
        self.pipeline = PipelineOptions.of(pipeline_parallel_size, pipeline_schedule, microbatches, stages_per_rank)
        self._pipeline_steps: PipelineSteps | None = None
        check_context_parallel(context_parallel_size, context_parallel)
        if context_parallel_size > 1 and pipeline_parallel_size > 1:
            raise ValueError(f"strategy.context_parallel_size={context_parallel_size}: context parallelism does not"
                             " run beside pipeline stages yet; choose one of the two")
        self.context_parallel_size, self.context_parallel = context_parallel_size, context_parallel
        self.context: ContextParallel | None = None  # this rank's part of its context-parallel group, once set up
        self.expert_parallel_size = expert_parallel_size
        self.experts: ExpertParallel | None = None  # this rank's experts, once split
        self.output_views = OutputViews()  # FSDP2's warning about views a sharded module returns, made a check
        self.averages = ShardedAverages()  # Lightning's weight-averaging callbacks, their copy sharded as the model

    @override
    def preflight(self, trainer: Any, fit_arguments: dict[str, Any]) -> None:
        """On the launching process: a model already built (eagerly or on meta) must say what its blocks are, and
        its configured optimizer must be one that steps shards."""
        self.check_parallel_sizes()
        model = fit_arguments.get("model")
        require_shardable_optimizer(model, "fsdp")
        if isinstance(model, nn.Module) and next(model.parameters(), None) is not None:
            block_classes = self.block_classes_of(model)
            if self.pipeline.size > 1:
                refuse_learning_rate_finder(trainer, "fits the model twice, and pipeline stages split it in place in"
                                                     " the first fit")
                if why := router_loss_refusal(model, self.pipeline.size):
                    raise ValueError(why)
                if not self.holds_split(model):
                    self.pipeline.split(model, block_classes, pp_rank=0)
            if self.tensor_parallel_size != 1 and not is_overridden("configure_model", model, pl.LightningModule):
                self.tensor_parallel_plan_of(model)  # a configure_model may split the model itself
            if self.expert_parallel_size > 1 and (why := experts_refusal(model, self.expert_parallel_size)):
                raise ValueError(why)
            if self.context_parallel_size > 1 and (why := context_refusal(model, self.context_parallel_size)):
                raise ValueError(why)

    @override
    def model_refusal(self, model: nn.Module, parallel_dims: ParallelDims) -> str | None:
        """Its blocks, its pipeline split and its tensor-parallel plan, as `preflight` checks them at launch."""
        try:
            block_classes = self.block_classes_of(model)
            if self.pipeline.size > 1:
                if why := router_loss_refusal(model, self.pipeline.size):
                    return why
                self.pipeline.split(model, block_classes, pp_rank=0)
            if parallel_dims.tp > 1 and not is_overridden("configure_model", model, pl.LightningModule):
                resolve_plan(model, self.tensor_parallel_plan, parallel_dims.tp)  # else it may split itself
        except ValueError as refusal:
            return str(refusal)
        if parallel_dims.cp > 1 and (why := context_refusal(model, parallel_dims.cp)):
            return why
        return experts_refusal(model, parallel_dims.ep) if parallel_dims.ep > 1 else None

    @property
    def parallel_sizes(self) -> ParallelSizes:
        """The sizes this strategy was given, as the config check before launch reads them from its keys."""
        return ParallelSizes(tensor=self.tensor_parallel_size, context=self.context_parallel_size,
                             pipeline=self.pipeline.size, replicate=self.data_parallel_replicate_size,
                             hybrid=self.hybrid, expert=self.expert_parallel_size)

    @override
    def weight_averaging_refusal(self, callback: Any) -> str | None:
        from lightning.pytorch.callbacks import WeightAveraging

        if not isinstance(callback, WeightAveraging):
            return ("shards the weights, which its copy cannot take (FSDP2's DTensors): Lightning's WeightAveraging"
                    " (whose default average is SWA's) or EMAWeightAveraging keep their copy sharded under ld_fsdp")
        if self.pipeline.size > 1:
            return ("splits the model into pipeline stages, whose saves it does not lay out: average the weights"
                    " without pipeline stages")
        return None

    @property
    @override
    def quantized_support(self) -> QuantizedSupport:
        """FSDP2 shards a 4-bit weight's float storage as flat numbers, and gathers it in its mixed-precision dtype."""
        policy = mixed_precision_policy(self.precision_plugin.precision)
        return data_parallel_support(self.parallel_sizes, shards=True, holds_in=policy.param_dtype if policy else None)

    def check_parallel_sizes(self) -> None:
        """The sizes fit the ranks (trainer.devices x trainer.num_nodes), and a tensor-parallel group fits a node."""
        self.parallel_sizes.check(self.num_processes, self.num_nodes)

    def tensor_parallel_plan_of(self, model: nn.Module) -> TensorParallelPlan:
        """The configured plan, or the model's own, checked against `model`."""
        return resolve_plan(model, self.tensor_parallel_plan, self.parallel_dims.tp)

    def block_classes_of(self, model: nn.Module) -> BlockClasses:
        """The configured block classes, each present in `model`, or those inferred from its layer stacks."""
        return self.blocks.classes_in(model)

    precision_support = PrecisionSupport(fp16_loss_scaling=False)  # FSDP2 has no gradient scaler for fp16

    @property
    @override
    def dry_run_refusal(self) -> str | None:  # type: ignore[override]
        return pipeline_dry_run_refusal(self.pipeline.schedule) if self.pipeline.size > 1 else None

    @property
    def pipeline_split(self) -> PipelineSplit | None:
        """How the model is split into pipeline stages, once `parallelize` split it; None without stages."""
        return self._pipeline_split

    @property
    def pipeline_views(self) -> list[nn.Module]:
        """This rank's pipeline stages, once `parallelize` made them."""
        return self._pipeline_views

    def forget_pipeline_stages(self) -> None:
        """Let the next `parallelize` split its model afresh: the dry run sets up one rank after another with one
        strategy (a run keeps its stages from fit to test)."""
        self._pipeline_split, self._pipeline_views, self._pipeline_steps = None, [], None
        self._split_module = None

    def holds_split(self, model: Any) -> bool:
        """Whether `model` is the module this strategy split into its stages (fit, then test or fit again)."""
        return self._pipeline_split is not None and self._split_module is not None and self._split_module() is model

    def memory_layout(self, name: str) -> Layout:
        offload = "cpu" if self.cpu_offload else None
        return Layout(
            name, "torch", shard_parameters=True, shard_gradients=True, shard_optimizer=True,
            keep_gathered=not self.reshard_after_forward, offload_optimizer=offload, offload_parameters=offload,
            activation_checkpointing=self.activation_checkpointing, sizes=self.parallel_sizes,
            reduce_scatter_per_block=True, pretrained_read_by_shard=True,
            pipeline_in_flight=self.pipeline.in_flight_share(),
            pipeline_receive_buffers=self.pipeline.receive_buffers(),
        )

    @property
    def parallel_dims(self) -> ParallelDims:
        """Every rank shards, or the ranks left by tensor parallelism; HYBRID_SHARD shards within a node and
        replicates across nodes."""
        return self.parallel_sizes.dims(self.num_processes, self.num_nodes)

    @property
    @override
    def keeps_state_on_host(self) -> bool:
        return self.cpu_offload

    @override
    def offload_targets(self) -> dict[str, str | None]:
        offloads = {record.offload_to_cpu for record in fully_sharded_parameters(self.model)}
        on_host = "cpu" if offloads == {True} else None
        return {"optimizer": on_host, "parameters": on_host}

    @override
    def setup_environment(self) -> None:
        # Lightning's own set-up (the accelerator's device), then the process group and the mesh of our dimensions.
        # ModelParallelStrategy's set-up would size its data x tensor mesh by its own `data_parallel_size` and
        # `tensor_parallel_size`; the mesh built here has its axes (and HSDP's two as well).
        with self.forming_process_group():
            Strategy.setup_environment(self)
            self._setup_distributed()
        give_device_mesh(self.lightning_module, self.build_device_mesh(self.root_device.type))
        self.averages.take_over(attached_trainer(self.lightning_module))  # before the callbacks' setup hooks

    def build_device_mesh(self, device_type: str) -> DeviceMesh:
        """The mesh of this strategy's parallel dimensions over the default process group, kept as its own (a
        collective: every rank builds it)."""
        self._device_mesh = self.parallel_dims.build_mesh(device_type)
        return self._device_mesh

    # `train.py` and `trainer.init_module()` build the model without weights under this strategy.
    @property
    def initializes_shards(self) -> bool:
        return True

    dry_run_shards = True

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """`trainer.init_module()` and `configure_model`: parameters on the meta device (buffers stay real); `setup`
        shards them and each rank initialises its own shards. `empty_init=False` builds the whole model eagerly."""
        deferred = nullcontext() if empty_init is False else parameters_on_meta()
        with deferred, self.precision_plugin.tensor_init_context():
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.hold_weights(self.model)  # this setup replaces Lightning's, and StrategyBase's with it
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        if has_meta_parameters(self.model):
            # The order torchtitan uses: shard the model while it has no memory, then initialise the shards.
            roots = self.parallelize(self.model)
            device = shard_device(self.cpu_offload, self.root_device)
            materialize_shards(self.model, device, seed=self.broadcast(torch.initial_seed()), roots=roots)
            self.model_to_device()  # the buffers
        else:
            self.model_to_device()
            roots = self.parallelize(self.model)
        if self._pipeline_split is not None and self._pipeline_steps is None:
            self._pipeline_steps = self.pipeline.steps(self, self._pipeline_split, roots)
        refuse_own_save_pretrained(self.model, self.strategy_name)
        load_saved_names_into_compiled_parts(self.model)
        if self.parallel_dims.cp > 1:
            cp_rank = self.parallel_dims.coordinates(self.global_rank)["cp"]
            self.context = self.context_axis(self.device_mesh, cp_rank, self.root_device, self.lightning_module)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            check_placements(self.model.parameters())  # here, not in the first step: it reads on the host
            self.averages.build(self.lightning_module)
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        # Under tensor parallelism the gradients lie on two meshes, which torch's clip_grad_norm_ cannot combine.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
        if trainer.state.fn == TrainerFn.FITTING:
            move_optimizers_to_device(self.optimizers, self.root_device)

    _pipeline_split: PipelineSplit | None = None
    _pipeline_views: list[nn.Module] = []
    _split_module: weakref.ref[nn.Module] | None = None

    def context_axis(self, mesh: DeviceMesh, cp_rank: int, device: torch.device, model: nn.Module) -> ContextParallel:
        """Context-parallel rank `cp_rank` of `mesh`'s context axis, its collectives' tensors on `device`, counting
        one exchange per block of `model` in each step: the run's, and the dry run's (strategies/torch/dry_run.py)."""
        check_context_parallel(self.parallel_dims.cp, self.context_parallel, device_type=device.type)
        context = context_parallel_of(self.context_parallel, mesh[CONTEXT_PARALLEL], cp_rank, self.parallel_dims.cp,
                                      device)
        context.expect_exchanges(model, self.blocks.classes_in(model), recomputes=self.blocks.checkpointing is not None)
        return context

    def parallelize(self, model: nn.Module) -> list[nn.Module]:
        """Pipeline stages outermost (each rank keeps its stages' part of the model), then tensor parallelism, then
        activation checkpointing, then compilation, then sharding: FSDP shards the checkpoint wrapper of each
        block, so the block's parameters are gathered before backward recomputes it. Returns FSDP's roots: the
        model, or this rank's pipeline stages."""
        block_classes = self.block_classes_of(model)
        if self.parallel_dims.pp > 1 and not self.holds_split(model):
            self.forget_pipeline_stages()  # a module not split before: fit, then test another
            pp_rank = self.parallel_dims.coordinates(self.global_rank)["pp"]
            self._pipeline_split = self.pipeline.split(model, block_classes, pp_rank)
            self._pipeline_split.prune(model)
            self._split_module = weakref.ref(model)
        if self.parallel_dims.tp > 1 and not any(isinstance(p, DTensor) for p in model.parameters()):
            # Split first (a configure_model that split the model itself is left as it is), as torchtitan orders it.
            apply_tensor_parallel(model, self.device_mesh[TENSOR_PARALLEL], self.tensor_parallel_plan_of(model))
        dims = self.parallel_dims
        if dims.ep > 1 and (self.experts is None or not self.experts.holds(model)):
            self.experts = ExpertParallel(model, dims.expert_mesh(self.device_mesh), dims.expert_rank(self.global_rank))
        self.blocks.apply(model, block_classes, device_type=self.root_device.type)  # checkpointing, then compilation
        if self._pipeline_split is not None and not self._pipeline_views:  # fit, then test: the same stages
            self._pipeline_views = list(self._pipeline_split.views(model))
        roots: list[nn.Module] = [model] if self._pipeline_split is None else list(self._pipeline_views)
        for root in roots:
            apply_fully_shard(
                root,
                mesh=self.parallel_dims.sharding_mesh(self.device_mesh),
                block_classes=self.pipeline.sharded_block_classes(block_classes),
                reshard_after_forward=self.reshard_after_forward,
                offload=offload_policy(self.cpu_offload, self.root_device),
                mixed_precision=mixed_precision_policy(self.precision_plugin.precision),
                forward_methods=[m for m in _STEP_METHODS if hasattr(root, m)],
                experts=[] if self.experts is None else self.experts.modules,
                experts_mesh=dims.expert_sharding_mesh(self.device_mesh) if self.experts else None,
            )
            if self._pipeline_split is None:  # a pipeline's stages pass activations on: its schedule owns them
                self.output_views.watch(fully_sharded_units(root))
        return roots

    @override
    def step_axes(self) -> list[StepAxis]:
        return [axis for axis in (self._pipeline_steps, self.context, self.experts) if axis is not None]

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        self.output_views.check_step()  # what a pipeline's stages pass on is not watched: its schedule owns them
        return output

    @property
    def pipeline_bubble(self) -> float | None:  # type: ignore[override]
        if self.pipeline.size == 1:
            return None
        return self.pipeline.layout(blocks=None).bubble_fraction(self.pipeline.microbatch_count)

    @property
    def pipeline_idle(self) -> IdleClock | None:
        return None if self._pipeline_steps is None else self._pipeline_steps.idle_clock

    @override
    def gradient_norm_scope(self) -> tuple[Any, set[int]]:
        if self._pipeline_steps is None:
            return None, set()
        return self._pipeline_steps.pp_group, self._pipeline_steps.tied.duplicates()

    def _clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        across, counted_elsewhere = self.gradient_norm_scope()
        clip_grad_norm_(self.precision_plugin.main_params(optimizer), clip_val, across=across, skip=counted_elsewhere)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        if not self._save_distributed_checkpoint:  # a weight average's shards are gathered as the model's were
            checkpoint = gathered_average(checkpoint, keep=self.is_global_zero)
        if not self._save_distributed_checkpoint or self.async_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options (got {storage_options!r})")
        # As Lightning's, with the save's id in every shard file (checkpoints/save_id.py), swapped in when whole.
        checkpoint = self.without_frozen_weights(self.with_samples_per_batch(checkpoint))  # as in every other save
        write_then_swap(
            self, self.broadcast(filepath), lambda partial: self.sharded_write(checkpoint, partial, staged=False)()
        )

    def staged_write(self, checkpoint: dict[str, Any], partial: Path) -> Callable[[], None]:
        """Background saves: the shards, each rank's staged now, and the rest as Lightning's metadata file."""
        if not self._save_distributed_checkpoint:
            return super().staged_write(checkpoint, partial)
        return self.sharded_write(checkpoint, partial)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        # Sharded directories (at any world size) load through Lightning, each rank reading its part; a full file
        # or a DeepSpeed directory is read by rank 0, and its weights are broadcast into the shards.
        # Pipeline stages read every checkpoint that way, their own too: each stage takes its part by name, at
        # any pipeline or data-parallel size, and the copies of a tied weight take the weight's state.
        checkpoint_path = self.broadcast(checkpoint_path)
        with self._optimizers_restored_when_fitting():
            return self._load(checkpoint_path, weights_only_for(checkpoint_path, weights_only))

    @contextmanager
    def _optimizers_restored_when_fitting(self) -> Iterator[None]:
        """`trainer.test`, `validate` or `predict` after `trainer.fit` read no optimizer state: the fit's optimizers
        are still this strategy's, over the module fitted, which need not be the module evaluated (DCP stopped with
        `KeyError: 0` on `trainer.test(Model(), ckpt_path=...)`)."""
        optimizers = self.optimizers
        if self.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            self.optimizers = []
        try:
            yield
        finally:
            self.optimizers = optimizers

    def _load(self, checkpoint_path: str | Path, weights_only: bool | None) -> dict[str, Any]:
        pipeline = self._pipeline_steps
        source = CheckpointSource.of(checkpoint_path, trusted=weights_only is False)
        # A save without its frozen weights loads around them, as another engine's: DCP's reader would want them.
        sharded = source.format == DISTRIBUTED and pipeline is None and not left_frozen_weights_out(source)
        foreign = load_for_resume(self, source, {DISTRIBUTED} if sharded else set(), weights_only)
        if foreign is None:
            checkpoint = self._load_sharded(checkpoint_path, weights_only)
            # As Lightning's callback restores it (since its fit, from every checkpoint loaded, for a test too: the
            # model then tests its own weights, as under DDP): both, as shards.
            if saved_with_an_average(checkpoint, attached_trainer(self.lightning_module)):
                checkpoint |= {"state_dict": sharded_weights(self.model),  # the average: Lightning loaded it
                               CURRENT_MODEL_STATE: read_current_weights(self.model, checkpoint_path)}
            return self.read_loader_record(checkpoint)
        strict = self.lightning_module.strict_loading
        load_weights_from_rank_zero(self.model, foreign, strict=strict, partial=None if pipeline is None else self)
        if saved_with_an_average(foreign, attached_trainer(self.lightning_module)):  # the average, then the model's
            average = sharded_weights(self.model)
            current = {**foreign, "state_dict": foreign[CURRENT_MODEL_STATE]}
            load_weights_from_rank_zero(self.model, current, strict=strict)
            foreign |= {"state_dict": average, CURRENT_MODEL_STATE: sharded_weights(self.model)}
        if self.optimizers:  # fitting: restore Adam's moments into the shards too
            restore_optimizer_by_name(self, self.model, self.optimizers, foreign,
                                      whole_model_groups=None if pipeline is None else pipeline.whole_model_groups,
                                      aliases=None if pipeline is None else pipeline.tied_aliases())
        return self.read_loader_record(foreign)

    def _load_sharded(self, checkpoint_path: str | Path, weights_only: bool | None) -> dict[str, Any]:
        """A sharded directory, through Lightning; one rank reads it as one process (background.py says why)."""
        drop_group_keys_not_saved(self.optimizers, checkpoint_path)
        if self.world_size > 1:
            return super().load_checkpoint(checkpoint_path, weights_only)
        with checkpoint_loads_in_one_process() as loads:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        if loads() == 0:
            raise RuntimeError(f"{type(self).__name__}: Lightning loaded {checkpoint_path} without"
                               " torch.distributed.checkpoint.load, which one rank reads as one process; this"
                               " Lightning is not one lightning-dist supports")
        return checkpoint

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        state = super().optimizer_state(optimizer)
        if self._pipeline_steps is not None and "param_groups" in state:
            # The whole model's groups, as an unpipelined run saves them: a stage lists only its own names, and
            # which stage's list a checkpoint keeps is up to the writer.
            names = self._pipeline_steps.whole_model_groups([list(group["params"]) for group in state["param_groups"]])
            state["param_groups"] = [{**group, "params": params} for group, params in zip(state["param_groups"], names)]
        return state

    @override
    def model_to_device(self) -> None:
        # With CPU offload the shards live in host memory (FSDP moves each unit to the device when it runs); the
        # rest of the module's state, its buffers and metrics, is used on the device.
        if self.cpu_offload:
            move_module_state(self.model, self.root_device)
        else:
            super().model_to_device()
