"""DeepSpeed ZeRO stages 1-3 with CPU or NVMe offload, on CUDA (nccl) or CPU (gloo, DeepSpeed's CPU accelerator).

The hooks only: the config and its rules live in `config/`, the engine's set-up in `engine.py`, checkpoint
loading in `load.py`, the offloaded optimizer in `offload.py` (this slice, strategies/deepspeed/).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision.deepspeed import DeepSpeedPrecision
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.strategies import DeepSpeedStrategy as _LightningDeepSpeedStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from typing_extensions import override

from lightning_dist._compat.deepspeed import (
    engine_saves,
    forget_process_groups,
    overflow_tested_on_host,
    read_gradient_norm_on_host,
    zero3_partitions,
)
from lightning_dist._compat.lightning import module_optimizers, validate_cuda_device_indices
from lightning_dist._compat.transformers import (
    ZeRO3Declaration,
    declare_zero3,
    recapture_outputs_after_hooks_removed,
    transformers_models,
    withdraw_zero3,
)
from lightning_dist.checkpoints.autoep_names import AUTOEP_NAMES
from lightning_dist.checkpoints.formats import CheckpointError
from lightning_dist.checkpoints.frozen_weights import frozen_weights_out_of_state_dicts
from lightning_dist.checkpoints.gather import plain_name
from lightning_dist.checkpoints.resume import group_names
from lightning_dist.lifecycle.process_exit import forget_with_process_group
from lightning_dist.memory.layout import Layout
from lightning_dist.parallel.context_parallel import ContextParallel, context_refusal
from lightning_dist.parallel.dims import ParallelDims
from lightning_dist.parallel.module_state import move_module_state
from lightning_dist.parallel.precision import PrecisionSupport
from lightning_dist.parallel.quantized import QuantizedSupport, data_parallel_support
from lightning_dist.parallel.sharded_init import has_meta_parameters, parameters_on_meta
from lightning_dist.parallel.sizes import ParallelSizes
from lightning_dist.strategies.axis_steps import StepAxis
from lightning_dist.strategies.base import StrategyBase
from lightning_dist.strategies.deepspeed.autoep import (
    autoep_finds_the_blocks,
    autoep_size,
    experts_to_split,
    model_names,
)
from lightning_dist.strategies.deepspeed.autoep import model_refusal as autoep_model_refusal
from lightning_dist.strategies.deepspeed.autotp import (
    check_tensor_parallel_inputs,
    initialize_inference_engine,
    sum_replicated_gradients,
)
from lightning_dist.strategies.deepspeed.autotp import (
    model_refusal as autotp_model_refusal,
)
from lightning_dist.strategies.deepspeed.average import average_into_client_state, average_out_of_client_state
from lightning_dist.strategies.deepspeed.clipping import HOOK_IGNORED_WARNING, ClippingInTheEngine
from lightning_dist.strategies.deepspeed.config.for_run import Resolution, RunConfig, config_in_effect
from lightning_dist.strategies.deepspeed.config.preflight import check_before_launch
from lightning_dist.strategies.deepspeed.config.zero import OPTIMIZER_TILE, ZeroSection
from lightning_dist.strategies.deepspeed.deferred_compile import import_muon_with_deferred_compilation
from lightning_dist.strategies.deepspeed.engine import (
    initialize_deferred_parameters,
    say_the_host_where_there_is_no_cuda,
    use_deepspeed_accelerator,
)
from lightning_dist.strategies.deepspeed.experts import expert_layers_as_leaves, refuse_expert_layers_under_zero_1_2
from lightning_dist.strategies.deepspeed.layout import zero_layout
from lightning_dist.strategies.deepspeed.load import load_deepspeed_checkpoint
from lightning_dist.strategies.deepspeed.offload import offload_device, optimizer_for_offload
from lightning_dist.strategies.deepspeed.outermost_forward import run_root_hooks_once_per_forward
from lightning_dist.strategies.deepspeed.precision import FrozenWeightsAsLoaded
from lightning_dist.strategies.deepspeed.trainable_groups import leave_frozen_weights_out, schedule_every_group
from lightning_dist.strategies.deepspeed.ulysses import deepspeed_ulysses, sequence_parallel_group
from lightning_dist.strategies.deepspeed.zero3_runtime import prepare_zero3_runtime
from lightning_dist.strategies.refusals import deepspeed_refusal, frozen_left_out_refusal
from lightning_dist.strategies.tuner import refuse_learning_rate_finder

if TYPE_CHECKING:
    from lightning_dist.dry_run.ranks import RankView


def run_directory(trainer: Any) -> Path | None:
    """Where the run keeps its files: the Trainer's root directory (train.py's run directory), else its logger's
    (a plain script's `lightning_logs/version_N`); None for a plain script without a logger, whose root is the working
    directory Lightning defaulted to: nothing of ours is written into a directory the user did not choose."""
    working = Path.cwd().resolve()
    # The logger's own directory, not `trainer.log_dir`: that broadcasts it, before DeepSpeed's group is ready.
    logger_dir = getattr(trainer.logger, "log_dir", None) if trainer.logger is not None else None
    for directory in (trainer.default_root_dir, logger_dir):
        if directory and Path(directory).resolve() != working:
            return Path(directory)
    return None


def refuse_several_optimizers(model: nn.Module) -> None:
    """DeepSpeed's engine steps one optimizer. Lightning refuses more (a GAN's two) only in the ranks, each with a
    traceback; here in one line before they start. Only a module that steps its optimizers itself can have several
    (Lightning 2), and only its configure_optimizers is called here; one that needs the fitting Trainer is left to
    Lightning."""
    if getattr(model, "automatic_optimization", True):
        return
    try:
        optimizers = module_optimizers(model)
    except Exception:
        return
    if len(optimizers) > 1:
        names = ", ".join(type(optimizer).__name__ for optimizer in optimizers)
        raise ValueError(f"configure_optimizers returns {len(optimizers)} optimizers ({names}): DeepSpeed's engine "
                         "steps one; train this module under fsdp or ddp, or give one optimizer its parameter groups")


def refuse_accumulation_schedule(trainer: Any) -> None:
    """Lightning's DeepSpeed strategy refuses a `GradientAccumulationScheduler` only in the ranks, at the start of
    training, each with a traceback; here in one line before they start."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    if any(isinstance(callback, GradientAccumulationScheduler) for callback in getattr(trainer, "callbacks", [])):
        raise ValueError("GradientAccumulationScheduler changes accumulate_grad_batches between epochs, which"
                         " Lightning's DeepSpeed strategy refuses (DeepSpeed's batch sizes are fixed as its engine is"
                         " built): set trainer.accumulate_grad_batches instead, or train under fsdp or ddp")


class DeepSpeedStrategy(StrategyBase, _LightningDeepSpeedStrategy):
    """DeepSpeed ZeRO that also runs on CPU, and takes Hugging Face-style configs with "auto" values.

    Args:
        stage: 1 shards optimizer state, 2 also gradients, 3 also parameters (default: the config file's, else 2).
        offload_optimizer: "cpu" or "nvme": optimizer state and step there (torch Adam/AdamW become DeepSpeed's CPU
            Adam).
        offload_parameters: ZeRO-3 only: parameters on "cpu" or "nvme" between uses.
        nvme_path: directory that NVMe offload writes to.
        config: a DeepSpeed config (dict or JSON path) to start from: its "auto" values are filled from the Trainer,
            the module and the data, contradictions (with them or the options above) reported before any rank starts,
            and the resolved config written to the run's directory.
        process_group_backend: "gloo", "nccl" or per device type ("cpu:gloo,cuda:nccl"); unset: chosen from the
            accelerator and where the state lives.
        timeout: how long a collective waits for the other ranks (seconds or a timedelta) before the run fails.
        tensor_parallel_size: DeepSpeed AutoTP: ranks that split each linear layer of a `transformers` model (the
            config's `tensor_parallel.autotp_size`); ZeRO partitions over the data-parallel ranks that are left.
            Unset: the config file's size, else 1.
        activation_checkpointing: recompute activations in backward: true (every block), "ops" (every block,
            keeping the outputs of its matrix products and attention), or an integer k (every k-th block).
        compile: compile each block with torch.compile (regional compilation) before `deepspeed.initialize`.
        block_class: the repeated layer (class or dotted path, or a list) that the two options above act on; unset:
            the classes of the model's layer stacks.
        async_checkpoint: refused before launch: DeepSpeed's engine writes its checkpoints itself.
        context_parallel_size: DeepSpeed's Ulysses: ranks that split each sequence, each holding a contiguous shard
            from the embedding to the loss, attention exchanged by DeepSpeed's `DistributedAttention` (the heads must
            divide by the size); ZeRO partitions over every rank. The config's `sequence_parallel_size`. Unset: the
            config file's size, else 1.
        expert_parallel_size: DeepSpeed's AutoEP: ranks that split each mixture-of-experts layer's experts (a
            transformers MoE model AutoEP has a preset for; strategies/deepspeed/autoep.py). The config's
            `expert_parallel` section. Unset: the config file's, else 1.
        exclude_frozen_parameters: checkpoints leave the frozen weights out (a LoRA run's base) and record each
            one's fingerprint; a resume takes them from the model it builds once those match
            (checkpoints/frozen_weights.py).
    """

    if TYPE_CHECKING:  # Lightning's types, for a strategy not yet set up; ours reads them once it is
        config: dict[str, Any]
        parallel_devices: list[torch.device]

    strategy_name = "ld_deepspeed"
    context: ContextParallel | None = None  # this rank's part of its Ulysses group, once set up
    _sequence_group: Any = None  # Ulysses' group, formed with the process group

    def __init__(
        self,
        stage: int | None = None,
        offload_optimizer: str | None = None,
        offload_parameters: str | None = None,
        nvme_path: str | Path | None = None,
        config: str | Path | dict[str, Any] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        tensor_parallel_size: int | None = None,
        activation_checkpointing: bool | str | int = False,
        compile: bool = False,
        block_class: str | type[nn.Module] | Sequence[str | type[nn.Module]] | None = None,
        async_checkpoint: bool = False,
        context_parallel_size: int | None = None,
        expert_parallel_size: int | None = None,
        exclude_frozen_parameters: bool = False,
    ) -> None:
        say_the_host_where_there_is_no_cuda()  # before Lightning's constructor has DeepSpeed look for a device
        self.run_config = RunConfig.of(
            stage, offload_optimizer, offload_parameters, nvme_path, config, tensor_parallel_size,
            context_parallel_size, expert_parallel_size,
        )
        super().__init__(
            stage=2 if stage is None else stage, config=self.run_config.user_config, sub_group_size=OPTIMIZER_TILE,
            offload_optimizer=offload_optimizer is not None, offload_optimizer_device=offload_optimizer or "cpu",
            offload_parameters=offload_parameters is not None, offload_params_device=offload_parameters or "cpu",
            nvme_path=str(nvme_path or ""), process_group_backend=process_group_backend, timeout=timeout,
            block_class=block_class, activation_checkpointing=activation_checkpointing, compile=compile,
            async_checkpoint=async_checkpoint, exclude_frozen_parameters=exclude_frozen_parameters,
        )
        self.base_config = self.config  # the file, or the config built from the options; never modified
        self.config_resolved_for_fit = False
        self.zero3_declared: ZeRO3Declaration | None = None  # transformers told of ZeRO-3 while the engine runs

    @property
    def zero(self) -> ZeroSection:  # the options over the file's section
        return self.run_config.zero(self.base_config)

    @property
    @override
    def root_device(self) -> torch.device:
        device = super().root_device
        # DeepSpeed addresses a rank's device by index, on CPU too; torch ignores a CPU index, so this is harmless.
        return torch.device("cpu", self.local_rank) if device.type == "cpu" else device

    precision_support = PrecisionSupport(fp16_on_cpu=True, casts_weights=True)

    def memory_layout(self, name: str) -> Layout:
        return zero_layout(self, name)

    @property
    def tensor_parallel_size(self) -> int:
        """AutoTP's size: the option, else the file's (the two agree, or the run was refused before launch)."""
        size = self.run_config.zero_options.tensor_parallel_size
        if size == -1:
            return self.world_size
        in_file = (self.base_config.get("tensor_parallel") or {}).get("autotp_size")
        return size or (in_file if isinstance(in_file, int) and in_file > 1 else 1)

    @property
    def context_parallel_size(self) -> int:
        """Ulysses' size: the option, else the file's `sequence_parallel_size` (the two agree, or the run was refused
        before launch)."""
        size = self.run_config.zero_options.context_parallel_size
        in_file = self.base_config.get("sequence_parallel_size")
        return size or (in_file if isinstance(in_file, int) and in_file > 1 else 1)

    @property
    def expert_parallel_size(self) -> int:
        """AutoEP's size: the option, else the file's (the two agree, or the run was refused before launch)."""
        return self.run_config.zero_options.expert_parallel_size or autoep_size(self.base_config)

    @property
    def autoep_size(self) -> int:
        """The expert-parallel size of DeepSpeed's AutoEP, whose checkpoints name the experts its own way (the
        check of a checkpoint to resume reads it)."""
        return self.expert_parallel_size

    @property
    def parallel_sizes(self) -> ParallelSizes:
        """AutoTP's tensor-parallel, Ulysses' sequence-parallel and AutoEP's expert-parallel sizes, from its options
        or its config file."""
        return ParallelSizes(tensor=self.tensor_parallel_size, context=self.context_parallel_size,
                             expert=self.expert_parallel_size)

    @property
    @override
    def trainable_change_refusal(self) -> str | None:
        return "flattened those that were trainable at its setup into its optimizer's partitions"

    @override
    def weight_averaging_refusal(self, callback: Any) -> str | None:
        if self.zero.partitions_parameters:
            return ("partitions the weights, which the copy cannot take (ZeRO-3's module holds empty placeholders):"
                    " average the weights under ZeRO-1/2, ld_fsdp or ld_ddp")
        return None  # ZeRO-1/2: whole weights on every rank; the average saved beside the engine's (average.py)

    @property
    @override
    def quantized_support(self) -> QuantizedSupport:
        """DeepSpeed holds every parameter in its config's dtype (its engine casts the module, zero.Init each
        parameter as it is made); ZeRO-3 shards a 4-bit weight's float storage as flat numbers."""
        return data_parallel_support(self.parallel_sizes, shards=self.zero_stage_3, holds_in=self.parameter_dtype)

    @property
    def parameter_dtype(self) -> torch.dtype:
        """The dtype DeepSpeed holds the parameters in: its config's, else the one Lightning will give it."""
        for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            if ((self.config or {}).get(key) or {}).get("enabled") is True:
                return dtype
        precision = self.precision_plugin.precision
        return torch.bfloat16 if precision.startswith("bf16") else torch.float16 if precision.startswith("16") else (
            torch.float32)

    @property
    def parallel_dims(self) -> ParallelDims:
        """ZeRO partitions over every rank (DeepSpeed's hierarchical partitioning is not offered); under AutoTP the
        ranks of one tensor-parallel group (neighbours, as DeepSpeed groups them) share a batch, under Ulysses those of
        one sequence-parallel group (each holding a shard of its sequences)."""
        sizes = self.parallel_sizes
        if self.world_size % (sizes.tensor * sizes.context) or (sizes.tensor > 1 and sizes.context > 1):
            return ParallelDims(dp_shard=self.world_size)  # refused before launch
        ep = sizes.expert if (self.world_size // sizes.tensor) % sizes.expert == 0 else 1  # else refused before launch
        return ParallelDims.resolve(self.world_size, cp=sizes.context, tp=sizes.tensor, ep=ep)

    @property
    @override
    def keeps_state_on_host(self) -> bool:
        return self.zero.offloads_to_host

    @override
    def offload_targets(self) -> dict[str, str | None]:
        engine = self.deepspeed_engine
        return {"optimizer": offload_device(engine.zero_offload_optimizer()),
                "parameters": offload_device(engine.zero_offload_param())}

    @override
    def checks_nonfinite_on_device(self, checked: bool) -> None:
        # fp16's loss scaler learns from the steps DeepSpeed skips: there, it keeps testing every step.
        tested = not checked or bool((self.config.get("fp16") or {}).get("enabled"))
        read_gradient_norm_on_host(tested)
        overflow_tested_on_host(self.deepspeed_engine.optimizer, tested)

    @property
    @override
    def checkpoint_tensor_parallel(self) -> int:  # type: ignore[override]
        return self.tensor_parallel_size

    @property
    @override
    def dry_run_refusal(self) -> str | None:  # type: ignore[override]
        if self.tensor_parallel_size > 1:  # AutoTP needs a Hugging Face model, which a dry run does not build
            return "DeepSpeed's AutoTP (strategy.tensor_parallel_size > 1) is not dry-run yet"
        if self.context_parallel_size > 1:
            return ("DeepSpeed's sequence parallelism (strategy.context_parallel_size > 1) is not dry-run yet, FSDP's"
                    " is (strategy=fsdp)")
        return None

    @override
    def dry_run_rank(self, build: Callable[[], nn.Module], batch: Any, precision: str, devices: int, num_nodes: int,
                     rank: int, device_type: str) -> RankView:
        from lightning_dist.strategies.deepspeed.dry_run import rank_view  # fake tensors, trackers: a dry run only

        return rank_view(self, build, batch, precision, devices, num_nodes, rank, device_type)

    @override
    def dry_run_patches(self) -> AbstractContextManager:
        from lightning_dist.strategies.deepspeed.dry_run import loop_on_fake_tensors

        return loop_on_fake_tensors(self)

    @override
    def setup_environment(self) -> None:
        use_deepspeed_accelerator(self.root_device)
        # Lightning's DeepSpeedStrategy refuses anything but CUDA at this point; DDP's set-up is what remains.
        with self.forming_process_group():
            DDPStrategy.setup_environment(self)

    @override
    def setup(self, trainer: Any) -> None:
        if type(self.precision_plugin) is DeepSpeedPrecision:  # the Trainer's, which casts a whole module at 32-true
            self.precision_plugin = FrozenWeightsAsLoaded(self.precision_plugin.precision)  # type: ignore[arg-type]
        super().setup(trainer)

    @override
    def setup_distributed(self) -> None:
        if self.root_device.type == "cuda":
            validate_cuda_device_indices(self.parallel_devices)
        reset_seed()
        self.set_world_ranks()
        import deepspeed.comm

        if not (
            torch.distributed.is_initialized() and deepspeed.comm.is_initialized()
        ):  # `test` after `fit`: up already
            self._init_deepspeed_distributed()
        forget_with_process_group(forget_process_groups)  # the groups DeepSpeed caches die with the process group
        if self.context_parallel_size > 1:  # as the process group forms (a dry run's fake tensors are not on yet)
            self._sequence_group = sequence_parallel_group(self)

    @override
    def preflight(self, trainer: Any, fit_arguments: dict[str, Any]) -> None:
        """On the launching process: resolve the config with what is known before `setup`, and check it can run."""
        refuse_accumulation_schedule(trainer)
        # Its search schedules a torch optimizer: every rank stopped at its start (`TypeError: DeepSpeedZeroOptimizer
        # is not an Optimizer`), as under Lightning's DeepSpeed strategy (Lightning #13370).
        refuse_learning_rate_finder(trainer, "searches by scheduling a torch optimizer, which DeepSpeed's engine"
                                             " replaces with its own")
        check_before_launch(self.resolution, trainer, fit_arguments)
        self.check_options()
        if isinstance(model := fit_arguments.get("model"), nn.Module):
            refuse_several_optimizers(model)
            refuse_expert_layers_under_zero_1_2(model, self.zero.stage)
            if self.expert_parallel_size > 1 and next(model.parameters(), None) is not None:
                if why := autoep_model_refusal(model, self.expert_parallel_size, self.zero.partitions_parameters):
                    raise ValueError(why)
            if self.tensor_parallel_size > 1 and (why := autotp_model_refusal(model, self.tensor_parallel_size)):
                raise ValueError(why)
            if self.context_parallel_size > 1 and (why := context_refusal(model, self.context_parallel_size)):
                raise ValueError(why)
        super().preflight(trainer, fit_arguments)

    @override
    def model_refusal(self, model: nn.Module, parallel_dims: ParallelDims) -> str | None:
        try:
            refuse_expert_layers_under_zero_1_2(model, self.zero.stage)
        except ValueError as refusal:
            return str(refusal)
        if parallel_dims.tp > 1 and (why := autotp_model_refusal(model, parallel_dims.tp)):
            return why
        if parallel_dims.cp > 1 and (why := context_refusal(model, parallel_dims.cp)):
            return why
        if parallel_dims.ep > 1:
            return autoep_model_refusal(model, parallel_dims.ep, self.zero.partitions_parameters)
        return None

    def check_options(self) -> None:
        plan = self.blocks.checkpointing
        refusal = deepspeed_refusal(self.zero.stage, plan is not None and plan.ops, self.async_checkpoint)
        refusal = refusal or frozen_left_out_refusal(self.exclude_frozen_parameters,
                                                     tensor_parallel_size=self.tensor_parallel_size,
                                                     expert_parallel_size=self.expert_parallel_size)
        if refusal:
            raise ValueError(refusal)

    def resolution(
        self, trainer: Any, model: Any, loader: Any = None, datamodule: Any = None, in_rank: bool = True
    ) -> Resolution:
        return self.run_config.resolve(self.base_config, self.world_size, trainer, model, loader, datamodule, in_rank)

    @override
    def _init_config_if_needed(self) -> None:
        # Lightning resolves the config once per strategy. A `validate` (or `test`, `predict`) before `fit` resolved it
        # with no train loader, accumulation or optimizer, all of which fit's training engine needs: resolved again.
        module = self.lightning_module
        fitting = module is not None and module.trainer.state.fn == TrainerFn.FITTING
        if fitting and not self.config_resolved_for_fit:
            self._config_initialized = False
        super()._init_config_if_needed()
        self.config_resolved_for_fit |= fitting

    @override
    def _format_config(self) -> None:
        # Replaces Lightning's, which refuses a file that sets gradient_accumulation_steps (HF files say "auto").
        module = self.lightning_module
        if module is None:
            return
        resolution = self.resolution(module.trainer, module)
        # What the file decided where the Trainer was left unset: the Trainer follows it, from here (`setup`), before
        # the module is converted to the precision and before the first batch.
        if "precision" in resolution.trainer_settings:
            self.precision_plugin = FrozenWeightsAsLoaded(resolution.trainer_settings["precision"])
        if "accumulate_grad_batches" in resolution.trainer_settings:
            module.trainer.accumulate_grad_batches = resolution.trainer_settings["accumulate_grad_batches"]
        self.config = self.effective_config(resolution, run_directory(module.trainer))

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any = None) -> None:
        # Lightning warns, at ZeRO-3's first save, that the checkpoint is a directory and points at its conversion
        # to one file: here any strategy loads the directory as it is (lightning_dist.load_from_checkpoint).
        if self.deepspeed_engine is not None and not engine_saves(self.deepspeed_engine):  # every rank, or a hang
            raise CheckpointError(
                "trainer.save_checkpoint after trainer.test, validate or predict under ZeRO-3: Lightning evaluates"
                " with a DeepSpeed engine of its own, which cannot save; save before evaluating"
                " (trainer.save_checkpoint right after trainer.fit, or a ModelCheckpoint callback)")
        if names := getattr(self, "autoep_model_names", None):  # AutoEP's layers, read back in the model's names
            checkpoint = {**checkpoint, AUTOEP_NAMES: names}
        leaving_out = self.exclude_frozen_parameters and self.deepspeed_engine is not None
        frozen = {plain_name(name) for name, parameter in self.lightning_module.named_parameters()
                  if not parameter.requires_grad} if leaving_out else set()
        checkpoint = average_into_client_state(checkpoint, frozen)
        with warnings.catch_warnings(), (frozen_weights_out_of_state_dicts(self.deepspeed_engine.module)
                                         if leaving_out else nullcontext()):
            warnings.filterwarnings("ignore", message="When saving the DeepSpeed Stage 3 checkpoint")
            super().save_checkpoint(checkpoint, filepath, storage_options)

    def effective_config(self, resolution: Resolution, root_dir: str | Path | None) -> dict[str, Any]:
        """The config the engine runs, written to the run's directory (if it has one) by global rank 0
        (config/for_run.py)."""
        return config_in_effect(resolution, root_dir, self.is_global_zero)

    @property
    def initializes_shards(self) -> bool:
        """ZeRO-3: the model is built without weights, and each rank initialises its partitions (`init_deepspeed`)."""
        return self.zero.partitions_parameters

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        if not self.initializes_shards or empty_init is False:  # Lightning refuses False under ZeRO-3; we build eagerly
            with Strategy.tensor_init_context(self, empty_init):
                yield
            return
        with parameters_on_meta(), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Iterator[None]:
        yield  # not Lightning's zero.Init, which needs the resolved config: `init_deepspeed` partitions instead

    @override
    def init_deepspeed(self) -> None:
        expected_experts = experts_to_split(self.config, self.model)  # before ZeRO-3 partitions their parameters
        if expected_experts:  # not again for a test after fit, whose engine is built around AutoEP's layers
            self.autoep_model_names = model_names(self.config, self.model, expected_experts)
        if has_meta_parameters(self.model):
            if self.lightning_module.trainer.training and "optimizer" not in self.config:
                # configure_optimizers must see the parameters' shapes: once partitioned, each one reads (0,).
                self._optimizer_before_partitioning = self._init_optimizers()
            initialize_deferred_parameters(
                self.model, self.config, self.root_device, self.broadcast(torch.initial_seed())
            )
        elif zero3_partitions(self.lightning_module):
            # Partitioned by an earlier stage (fit, then test), whose teardown moved the module to the host
            # (Lightning's `.cpu()`): ZeRO-3's placeholders with it, and the small parameters it keeps whole and never
            # gathers again (measured with CUDA faked: the test's first embedding on the host). Back on the device.
            self.lightning_module.to(self.root_device)
        if self.zero_stage_3:
            prepare_zero3_runtime(self.config)
        import_muon_with_deferred_compilation()
        self.check_options()
        # In place; DeepSpeed's hooks then wrap the blocks.
        self.blocks.apply(self.model, hooks_outside=self.zero_stage_3, device_type=self.root_device.type)
        if self.zero_stage_3 and self.blocks.compile:
            from deepspeed.utils import set_z3_leaf_modules  # here: importing DeepSpeed takes seconds

            # Each compiled block gathers its parameters at once, in its own hook: no hooks inside the compiled code.
            set_z3_leaf_modules(self.model, list(self.blocks.classes_in(self.model)))
        if self.zero_stage_3:
            expert_layers_as_leaves(self.model)
        refuse_expert_layers_under_zero_1_2(self.model, self.zero.stage)  # experts built in configure_model
        if self.tensor_parallel_size > 1 and (why := autotp_model_refusal(self.model, self.tensor_parallel_size)):
            raise ValueError(why)  # a model built in configure_model
        with autoep_finds_the_blocks(self.config, self.model, expected_experts), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=HOOK_IGNORED_WARNING)  # clipping.py: the hook's norm is used
            super().init_deepspeed()
        if self.lightning_module.trainer.training:
            self.precision_plugin = ClippingInTheEngine(self.precision_plugin.precision, self.deepspeed_engine)
        move_module_state(self.lightning_module, self.root_device)  # ZeRO-3 placed the parameters only
        if self.tensor_parallel_size > 1:
            check_tensor_parallel_inputs(self.deepspeed_engine, self.root_device)
            sum_replicated_gradients(self.lightning_module)
        if self.context_parallel_size > 1 and self.context is None:  # fit, then test: the same group
            self.context = deepspeed_ulysses(self, self._sequence_group)
            self.context.expect_exchanges(self.lightning_module, self.blocks.classes_in(self.lightning_module),
                                          recomputes=self.blocks.checkpointing is not None)
        run_root_hooks_once_per_forward(self.deepspeed_engine)  # timers, profiler, ZeRO-3 trace: once per step
        if self.zero_stage_3 and transformers_models(self.lightning_module):
            # Its generate() then runs with synced_gpus: a rank whose text has ended goes on with forwards, each
            # gathering the parameters with every rank, until all have; else the others wait on it (a hang).
            self.zero3_declared = declare_zero3(self.config)

    @override
    def teardown(self) -> None:
        if self.zero3_declared is not None:
            withdraw_zero3(self.zero3_declared)
            self.zero3_declared = None
        super().teardown()

    @override
    def _initialize_deepspeed_inference(self, model: torch.nn.Module) -> None:
        if self.tensor_parallel_size == 1:
            super()._initialize_deepspeed_inference(model)
        else:
            self.model = initialize_inference_engine(self, model)
        recapture_outputs_after_hooks_removed(model)  # both removed every module hook first

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:  # any format
        checkpoint = load_deepspeed_checkpoint(self, checkpoint_path, weights_only, super().load_checkpoint)
        checkpoint = average_out_of_client_state(self.lightning_module, checkpoint)
        if isinstance(self.precision_plugin, ClippingInTheEngine):  # not the clipping norm the checkpoint's run had
            self.precision_plugin.use_configured_norm()
        return self.read_loader_record(checkpoint)

    @override
    def step_axes(self) -> list[StepAxis]:
        return [] if self.context is None else [self.context]

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        # Lightning ends each accumulation, at an epoch's last batch too, and steps the engine only then: each step()
        # is DeepSpeed's boundary (managed_gradient_accumulation=false, config/resolve.py fill_accumulation_boundary).
        return False

    @contextmanager
    @override
    def block_backward_sync(self) -> Iterator[None]:
        # Lightning's wrapper of the backwards it accumulates: it would enter the engine's no_sync, which ZeRO-2/3
        # refuse. Unneeded: an unmanaged backward reduces only what ZeRO-2/3 partition, and ZeRO-0/1 reduce in step().
        yield

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        # Lightning has already divided the loss by accumulate_grad_batches; by default DeepSpeed divides it by its
        # gradient_accumulation_steps again, shrinking gradients (and Adam's eps-relative updates) by that factor.
        return super().backward(closure_loss, optimizer, *args, scale_wrt_gas=False, **kwargs)

    @override
    def _init_optimizers(self):
        built, self._optimizer_before_partitioning = getattr(self, "_optimizer_before_partitioning", None), None
        if built is not None:
            return built
        optimizer, scheduler_config = super()._init_optimizers()
        # Before ZeRO flattens them: how a DDP checkpoint's optimizer state (by position) maps onto names.
        self.param_group_names = group_names(self.lightning_module, optimizer.param_groups)
        leave_frozen_weights_out(optimizer)  # trainable_groups.py: DeepSpeed's rules for the groups it is given
        if ZeroSection.of(self.config).offloads_optimizer:
            optimizer = self.optimizer_for_offload(optimizer, scheduler_config)
        schedule_every_group(optimizer, scheduler_config)
        return optimizer, scheduler_config

    def optimizer_for_offload(self, optimizer: torch.optim.Optimizer, scheduler_config: Any) -> torch.optim.Optimizer:
        """The configured optimizer as it steps offloaded state: torch's Adam and AdamW become DeepSpeed's CPU Adam."""
        return optimizer_for_offload(optimizer, scheduler_config, self.config)
