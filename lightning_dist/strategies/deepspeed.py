"""DeepSpeed ZeRO stages 1-3 with CPU or NVMe offload, on CUDA (nccl) or CPU (gloo, DeepSpeed's CPU accelerator)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningDataModule
from lightning.pytorch.plugins.precision.deepspeed import DeepSpeedPrecision
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.strategies import DeepSpeedStrategy as _LightningDeepSpeedStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_dist._compat.deepspeed import partitioner
from lightning_dist._compat.lightning import validate_cuda_device_indices
from lightning_dist.checkpoints.formats import DEEPSPEED, checkpoint_format
from lightning_dist.checkpoints.into_deepspeed import engine_reads_natively, load_into_engine
from lightning_dist.checkpoints.resume import group_names, load_for_resume
from lightning_dist.checkpoints.safe_load import vet_checkpoint
from lightning_dist.checkpoints.swap import SwappedSaves
from lightning_dist.checkpoints.universal import convert_on_rank_zero, loading_universal, saved_run
from lightning_dist.deepspeed_config import (
    Resolution,
    ZeroOptions,
    load_user_config,
    resolve,
    training_facts,
    write_effective_config,
)
from lightning_dist.deepspeed_config.gathering import gathering_sized_by_model
from lightning_dist.deepspeed_config.outputs import anchor_output_paths
from lightning_dist.deepspeed_config.preflight import check_offload_ready
from lightning_dist.deepspeed_config.resolve import buckets_sized_by_model
from lightning_dist.deepspeed_config.swap_buffers import swap_buffers_sized_by_model
from lightning_dist.optim import require_shardable_optimizer
from lightning_dist.parallel.deferred_compile import import_muon_with_deferred_compilation
from lightning_dist.parallel.dims import ParallelDims
from lightning_dist.parallel.devices import prepare_rank, process_group_backend, process_group_timeout
from lightning_dist.parallel.outermost_forward import run_root_hooks_once_per_forward
from lightning_dist.parallel.sharded_init import (
    ForgetsUnbuiltModel, Keep, give_memory, has_meta_parameters, initialize_parameters, parameters_on_meta,
)
from lightning_dist.parallel.zero3_runtime import swap_in_each_parameter_once, use_memory_efficient_linear
from lightning_dist.strategies.launcher import guarded

ZERO_STAGES = (1, 2, 3)
OFFLOAD_DEVICES = ("cpu", "nvme")
SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")
# ZeRO-3's optimizer tile (`sub_group_size`), in elements: the optimizer steps on one flat fp32 group at a time,
# with a gradient copy and Adam's temporaries the size of the group. Lightning's 1e12 makes a rank's whole
# partition one group: 2.4 GB of transients per rank for a 400M-parameter model in fp32 and, under NVMe offload,
# the whole optimizer partition swapped in at once (over 12 GB of host memory per rank for 2B parameters).
# 2.5e7: 0.3 GB of transients, 0.4 GB per group swapped in.
OPTIMIZER_TILE = 25_000_000


def validate_zero_options(stage: int | None, offload_optimizer: str | None, offload_parameters: str | None) -> None:
    """Reject impossible ZeRO options in one line that names the key and the valid choices. A None stage leaves it
    to the config file (or 2 without one); a file's own settings are checked against these when the run starts."""
    if stage is not None and stage not in ZERO_STAGES:
        raise ValueError(f"strategy.stage: {stage!r} is not a ZeRO stage; choose one of {', '.join(map(str, ZERO_STAGES))}")
    for key, device in (("offload_optimizer", offload_optimizer), ("offload_parameters", offload_parameters)):
        if device is not None and device not in OFFLOAD_DEVICES:
            raise ValueError(f"strategy.{key}: {device!r} is not an offload device; choose one of null, cpu, nvme")
    if offload_parameters is not None and stage not in (None, 3):
        raise ValueError(
            f"strategy.offload_parameters: parameter offload needs ZeRO stage 3, got strategy.stage={stage};"
            " choose strategy.stage=3 or strategy.offload_parameters=null"
        )


def use_deepspeed_accelerator(device: torch.device) -> str:
    """Point DeepSpeed at the accelerator matching Lightning's device; returns its name.

    DeepSpeed picks one by itself at import (CUDA when visible), which is wrong for `accelerator="cpu"` on a GPU
    machine. The environment variable makes the choice stick in processes DeepSpeed starts from this one.
    """
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if device.type not in SUPPORTED_DEVICE_TYPES:
        raise ValueError(
            f"trainer.accelerator: DeepSpeed runs on {' or '.join(SUPPORTED_DEVICE_TYPES)} here, not {device.type!r}"
        )
    if get_accelerator().device_name() != device.type:
        if device.type == "cuda":
            from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator as Accelerator
        else:
            from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator as Accelerator
        set_accelerator(Accelerator())
    os.environ["DS_ACCELERATOR"] = device.type
    return get_accelerator().device_name()


class DeepSpeedStrategy(SwappedSaves, ForgetsUnbuiltModel, _LightningDeepSpeedStrategy):
    """DeepSpeed ZeRO that also runs on CPU, and takes Hugging Face-style configs with "auto" values.

    Args:
        stage: ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters. Default: the config
            file's, else 2.
        offload_optimizer: keep optimizer state (and run the optimizer step) on "cpu" or "nvme"; null keeps it on
            the device. A plain torch Adam/AdamW is then swapped for DeepSpeed's CPU Adam.
        offload_parameters: ZeRO-3 only: keep parameters on "cpu" or "nvme" between uses.
        nvme_path: directory that NVMe offload writes to.
        config: a DeepSpeed config (dict or JSON path) to start from. Its "auto" values are filled from the Trainer,
            the LightningModule and the data; values that contradict them, or the options above, are reported
            together before any rank starts. The resolved config is written to the run's directory.
    """

    strategy_name = "ld_deepspeed"

    def __init__(
        self,
        stage: int | None = None,
        offload_optimizer: str | None = None,
        offload_parameters: str | None = None,
        nvme_path: str | Path | None = None,
        config: str | Path | dict[str, Any] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
    ) -> None:
        validate_zero_options(stage, offload_optimizer, offload_parameters)
        if config is None:
            if "nvme" in (offload_optimizer, offload_parameters) and not nvme_path:
                raise ValueError("strategy.nvme_path: NVMe offload needs a directory to offload to; set strategy.nvme_path")
            user_config, self.config_source, self.zero_options = None, "strategy", ZeroOptions()
        else:
            # The options are merged into the file when the run starts, where conflicts are reported with the rest.
            user_config, self.config_source = load_user_config(config)
            self.zero_options = ZeroOptions(stage, offload_optimizer, offload_parameters, str(nvme_path) if nvme_path else None)
        super().__init__(
            stage=2 if stage is None else stage,
            offload_optimizer=offload_optimizer is not None,
            offload_optimizer_device=offload_optimizer or "cpu",
            offload_parameters=offload_parameters is not None,
            offload_params_device=offload_parameters or "cpu",
            nvme_path=str(nvme_path or ""),
            sub_group_size=OPTIMIZER_TILE,
            config=user_config,
            process_group_backend=process_group_backend,
            timeout=process_group_timeout(timeout),
        )
        self.base_config = self.config  # the file, or the config built from the options; never modified

    @property
    @override
    def root_device(self) -> torch.device:
        device = super().root_device
        # DeepSpeed addresses a rank's device by index, on CPU too; torch ignores a CPU index, so this is harmless.
        return torch.device("cpu", self.local_rank) if device.type == "cpu" else device

    @property
    def parallel_dims(self) -> ParallelDims:
        """ZeRO partitions over every data-parallel rank (DeepSpeed's hierarchical partitioning is not offered)."""
        return ParallelDims(dp_shard=self.world_size)

    @override
    def setup_environment(self) -> None:
        use_deepspeed_accelerator(self.root_device)
        prepare_rank(self.root_device, self.num_processes, self._timeout)
        # Lightning's DeepSpeedStrategy refuses anything but CUDA at this point; DDP's set-up is what remains.
        DDPStrategy.setup_environment(self)

    @override
    def setup_distributed(self) -> None:
        if self.root_device.type == "cuda":
            validate_cuda_device_indices(self.parallel_devices)
        reset_seed()
        self.set_world_ranks()
        import deepspeed.comm

        if not (torch.distributed.is_initialized() and deepspeed.comm.is_initialized()):  # `test` after `fit`: up already
            self._init_deepspeed_distributed()

    @override
    def _get_process_group_backend(self) -> str:
        return self._process_group_backend or process_group_backend(self.root_device, host_state=self.offloads_to_host)

    @property
    def offloads_to_host(self) -> bool:
        """Whether the file or the options put optimizer state or parameters in host memory (or on NVMe, which
        DeepSpeed stages through host memory)."""
        zero = self.base_config.get("zero_optimization") or {}
        devices = {
            self.zero_options.offload_optimizer,
            self.zero_options.offload_parameters,
            (zero.get("offload_optimizer") or {}).get("device"),
            (zero.get("offload_param") or {}).get("device"),
        }
        return bool(devices & set(OFFLOAD_DEVICES))

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        self._launcher = guarded(self, self._launcher, self.preflight)

    def preflight(self, trainer: Any, fit_arguments: dict[str, Any]) -> None:
        """On the launching process: resolve the config with what is known before `setup` and check offload."""
        loader, datamodule = fit_arguments.get("train_dataloaders"), fit_arguments.get("datamodule")
        if isinstance(loader, LightningDataModule):
            loader, datamodule = None, loader
        if loader is not None and not hasattr(loader, "batch_sampler"):
            loader = None  # a list or dict of loaders: the in-rank pass reads the combined one
        resolution = self.resolution(trainer, fit_arguments.get("model"), loader, datamodule, in_rank=False)
        check_offload_ready(resolution.config)
        stage = resolution.config.get("zero_optimization", {}).get("stage", 0)
        if stage and "optimizer" not in resolution.config:  # else the file's optimizer replaces the module's
            require_shardable_optimizer(fit_arguments.get("model"), f"ZeRO stage {stage}")

    def resolution(self, trainer: Any, model: Any, loader: Any = None, datamodule: Any = None, in_rank: bool = True) -> Resolution:
        needs_optimizer = "optimizer" in self.base_config or "scheduler" in self.base_config
        facts = training_facts(trainer, model, loader, datamodule, need_optimizer=needs_optimizer, in_rank=in_rank)
        config = self.base_config
        if self.config_source == "strategy" and facts.hidden_size:  # a preset: no file chose the bucket sizes
            config = buckets_sized_by_model(config)
        resolution = resolve(config, facts, self.zero_options, self.config_source)
        if self.config_source == "strategy" and model is not None:  # nor how much is gathered, nor the NVMe pool
            config = gathering_sized_by_model(resolution.config, model.modules())
            resolution.config = swap_buffers_sized_by_model(config, model.modules(), self.world_size)
        return resolution

    @override
    def _format_config(self) -> None:
        # Replaces Lightning's, which refuses a file that sets gradient_accumulation_steps (HF files say "auto").
        module = self.lightning_module
        if module is None:
            return
        resolution = self.resolution(module.trainer, module)
        self._apply_trainer_settings(module.trainer, resolution.trainer_settings)
        for note in resolution.notes:
            rank_zero_info(note)
        self.config = anchor_output_paths(resolution.config, module.trainer.default_root_dir)
        # Without an optimizer block the optimizer comes from configure_optimizers, and ZeRO refuses the ones it
        # has not tested; Lightning's test/predict path under ZeRO-3 reads this key whether or not there is a block.
        self.config.setdefault("zero_allow_untested_optimizer", True)
        if self.is_global_zero:
            path = write_effective_config(self.config, module.trainer.default_root_dir)
            rank_zero_info(f"DeepSpeed config in effect: {path}")

    def _apply_trainer_settings(self, trainer: Any, settings: dict[str, Any]) -> None:
        """What the file decided where the Trainer was left unset (precision, accumulation): the Trainer follows it.
        This runs in `setup`, before the module is converted to the precision and before the first batch."""
        if "precision" in settings:
            self.precision_plugin = DeepSpeedPrecision(settings["precision"])
        if "accumulate_grad_batches" in settings:
            trainer.accumulate_grad_batches = settings["accumulate_grad_batches"]

    @property
    def initializes_shards(self) -> bool:
        """ZeRO-3 partitions parameters: `train.py`, `trainer.init_module()` and `configure_model` build the model
        without weights, and each rank initialises its partitions in `init_deepspeed`."""
        stage = self.zero_options.stage or (self.base_config.get("zero_optimization") or {}).get("stage")
        return stage == 3

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
        # Lightning's deepspeed.zero.Init here would need the resolved config (its "auto" values) before `setup`;
        # `tensor_init_context` defers the weights instead, and `init_deepspeed` partitions them.
        yield

    @override
    def init_deepspeed(self) -> None:
        if has_meta_parameters(self.model):
            if self.lightning_module.trainer.training and "optimizer" not in self.config:
                # configure_optimizers must see the parameters' shapes: once partitioned, each one reads (0,).
                self._optimizer_before_partitioning = self._init_optimizers()
            seed = self.broadcast(torch.initial_seed())
            meta = [p for p in self.model.parameters() if p.is_meta]
            keep = zero3_partitioner(self.config) if self.zero_stage_3 else whole_on(self.root_device)
            initialize_parameters(self.model, keep, seed, params=meta)
        if self.zero_stage_3:
            if (self.config.get("zero_optimization") or {}).get("memory_efficient_linear", True):
                use_memory_efficient_linear()
            swap_in_each_parameter_once()
        import_muon_with_deferred_compilation()
        super().init_deepspeed()
        run_root_hooks_once_per_forward(self.deepspeed_engine)  # timers, profiler, ZeRO-3 trace: once per step

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint_path = self.broadcast(checkpoint_path)
        native = checkpoint_format(checkpoint_path) == DEEPSPEED
        if native:
            if weights_only is not False:  # DeepSpeed unpickles its shards with weights_only=False
                vet_checkpoint(checkpoint_path)
            saved_world_size, saved_config = saved_run(checkpoint_path)
            native = engine_reads_natively(saved_config, self.config)
        if not native:  # DDP, FSDP, or another ZeRO layout: consolidated on rank 0, then partitioned
            checkpoint = load_for_resume(self, checkpoint_path, native_formats=set(), weights_only=weights_only)
            load_into_engine(self, checkpoint, strict=self.lightning_module.strict_loading)
            return checkpoint
        if saved_world_size in (None, self.world_size):
            return super().load_checkpoint(checkpoint_path, weights_only)
        # Written by another number of ranks: DeepSpeed re-partitions its universal form.
        convert_on_rank_zero(self, checkpoint_path)
        with loading_universal(self.deepspeed_engine, checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        # Lightning has already divided the loss by accumulate_grad_batches; by default DeepSpeed divides it by its
        # gradient_accumulation_steps again, shrinking gradients (and Adam's eps-relative updates) by that factor.
        return super().backward(closure_loss, optimizer, *args, scale_wrt_gas=False, **kwargs)

    @property
    def offloads_optimizer(self) -> bool:
        offload = (self.config.get("zero_optimization") or {}).get("offload_optimizer") or {}
        return offload.get("device", "none") != "none"

    @override
    def _init_optimizers(self):
        built, self._optimizer_before_partitioning = getattr(self, "_optimizer_before_partitioning", None), None
        if built is not None:
            return built
        optimizer, scheduler_config = super()._init_optimizers()
        # Before ZeRO flattens them: how a DDP checkpoint's optimizer state (by position) maps onto names.
        self.param_group_names = group_names(self.lightning_module, optimizer.param_groups)
        if not self.offloads_optimizer:
            return optimizer, scheduler_config
        if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
            optimizer = _as_deepspeed_cpu_adam(optimizer)
            if scheduler_config is not None:
                # The scheduler was built around the torch optimizer; it only reads and writes param_groups.
                scheduler_config.scheduler.optimizer = optimizer
        else:
            # DeepSpeed refuses other torch optimizers under offload although they work (stepping on the host).
            self.config["zero_force_ds_cpu_optimizer"] = False
            rank_zero_info(f"Optimizer offload: {type(optimizer).__name__} steps on the CPU (no DeepSpeed kernel for it)")
        return optimizer, scheduler_config


def zero3_partitioner(config: dict[str, Any]) -> Keep:
    """Hands each initialised parameter to ZeRO-3, which keeps this rank's partition (on the device, the host or
    NVMe, as the config's `offload_param` says) and frees the rest: what `deepspeed.zero.Init` does at the end of
    each module's constructor."""
    import deepspeed

    offload = ((config.get("zero_optimization") or {}).get("offload_param") or {}).get("device")
    # Not entered: only its conversion is used, not its patching of every module class's constructor.
    zero_init = deepspeed.zero.Init(config_dict_or_path=config, remote_device=offload if offload in OFFLOAD_DEVICES else None)
    to_zero_parameters = partitioner(zero_init)

    def partition(param: torch.nn.Parameter, full: torch.Tensor) -> None:
        # In the config's dtype (bf16, fp16), as a module built under zero.Init would be: DeepSpeed's own cast of the
        # module cannot reach partitions.
        give_memory(param, full.to(zero_init.dtype) if full.is_floating_point() else full)
        to_zero_parameters([param])

    return partition


def whole_on(device: torch.device) -> Keep:
    def keep(param: torch.nn.Parameter, full: torch.Tensor) -> None:
        give_memory(param, full.to(device))

    return keep


def _as_deepspeed_cpu_adam(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """DeepSpeed's offload runs the optimizer step on the host, where its vectorised CPU Adam is much faster than
    torch's: same parameter groups and hyper-parameters."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    defaults = optimizer.defaults
    cpu_adam = DeepSpeedCPUAdam(
        optimizer.param_groups,
        lr=defaults["lr"],
        betas=defaults["betas"],
        eps=defaults["eps"],
        weight_decay=defaults["weight_decay"],
        amsgrad=defaults.get("amsgrad", False),
        adamw_mode=isinstance(optimizer, torch.optim.AdamW),
    )
    rank_zero_info(f"Optimizer offload: {type(optimizer).__name__} replaced by DeepSpeedCPUAdam (same hyper-parameters)")
    return cpu_adam
