"""DDP: Lightning's own strategy, which already runs on CPU (gloo) and CUDA (nccl) alike."""

from __future__ import annotations

import gc
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from lightning.pytorch.strategies import DDPStrategy as _LightningDDPStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_dist._compat.lightning import wrap_in_new_ddp
from lightning_dist.checkpoints.formats import FILE
from lightning_dist.checkpoints.frozen_weights import LEFT_OUT, check_left_out, load_around_left_out, may_lack
from lightning_dist.checkpoints.resume import load_for_resume, restore_optimizer_by_name
from lightning_dist.checkpoints.source import weights_only_for
from lightning_dist.memory.layout import Layout
from lightning_dist.parallel.dims import ParallelDims
from lightning_dist.parallel.quantized import QuantizedSupport
from lightning_dist.strategies.base import StrategyBase
from lightning_dist.strategies.torch.replay import ReplayedOnTorch
from lightning_dist.strategies.torch.unused_parameters import unused_parameters_message
from lightning_dist.strategies.weight_averaging import saved_with_an_average, whole_average_and_current


class DDPStrategy(ReplayedOnTorch, StrategyBase, _LightningDDPStrategy):
    """Data-parallel training; registered as `ld_ddp` so it sits beside our FSDP and DeepSpeed presets.

    Lightning's DDP already runs on CPU. What this adds: gradients that live in DDP's buckets (one copy, not two),
    and resuming from FSDP and DeepSpeed checkpoint directories too (consolidated on load, Adam state included),
    at any world size.

    Args:
        *args: Lightning's `DDPStrategy` arguments (`accelerator`, `parallel_devices`, ...), as Lightning passes them.
        gradient_as_bucket_view: gradients as views of DDP's all-reduce buckets (one copy per gradient, not two).
        timeout: how long a collective waits for the other ranks (seconds or a timedelta) before the run fails.
        activation_checkpointing: recompute activations in backward: true (every block), "ops" (every block,
            keeping the outputs of its matrix products and attention), or an integer k (every k-th block).
        compile: compile each block with torch.compile (regional compilation) before DDP wraps the model.
        block_class: the repeated layer (class or dotted path, or a list) that the two options above act on; unset:
            the classes of the model's layer stacks.
        async_checkpoint: write checkpoints in the background: the step waits only while rank 0 copies the state.
        exclude_frozen_parameters: checkpoints leave the frozen weights out (a LoRA run's base) and record each
            one's fingerprint; a resume takes them from the model it builds once those match
            (checkpoints/frozen_weights.py).
        **kwargs: the rest of Lightning's `DDPStrategy` arguments (`process_group_backend`, `find_unused_parameters`,
            ...; extra keywords go to `DistributedDataParallel`).
    """

    strategy_name = "ld_ddp"
    quantized_support = QuantizedSupport()  # every rank holds a quantized base (QLoRA's) whole, as bitsandbytes made it

    def __init__(
        self,
        *args: Any,
        gradient_as_bucket_view: bool = True,
        timeout: timedelta | float | None = None,
        activation_checkpointing: bool | str | int = False,
        compile: bool = False,
        block_class: str | type[nn.Module] | Sequence[str | type[nn.Module]] | None = None,
        async_checkpoint: bool = False,
        exclude_frozen_parameters: bool = False,
        **kwargs: Any,
    ) -> None:
        # Gradients as views of DDP's all-reduce buckets: without it every rank holds each gradient twice (in
        # the parameter's .grad and in a bucket) and copies between them on every step.
        super().__init__(
            *args, gradient_as_bucket_view=gradient_as_bucket_view, timeout=timeout, block_class=block_class,
            activation_checkpointing=activation_checkpointing, compile=compile, async_checkpoint=async_checkpoint,
            exclude_frozen_parameters=exclude_frozen_parameters, **kwargs,
        )

    @override
    def _setup_model(self, model: nn.Module) -> DistributedDataParallel:
        self.blocks.apply(model, device_type=self.root_device.type)  # in place, before DDP registers its hooks
        return super()._setup_model(model)

    @override
    def follow_trainable_change(self) -> None:
        # DDP's reducer buckets the parameters that required grad when it wrapped the module: a new one over those
        # that train now (every rank at the same batch; its broadcast from rank 0 finds them equal). The old one's
        # gradient hooks go with it; the blocks' checkpointing and compilation are not applied again.
        module = self.lightning_module
        assert module is not None  # in a fit
        self.model = module  # the old wrapper's last reference
        gc.collect()
        wrap_in_new_ddp(self, module)

    @override
    def on_exception(self, exception: BaseException) -> None:
        module = self.model.module if isinstance(self.model, DistributedDataParallel) else self.lightning_module
        message = unused_parameters_message(exception, module) if module is not None else None
        if message is None:
            return super().on_exception(exception)
        exception.args = (message,)  # not Lightning's, which names its own DDP and not the parameters

    def memory_layout(self, name: str) -> Layout:
        # Everything replicated, nothing offloaded; autocast's weight copies, and the buckets rebuilt at step 2.
        return Layout(name, "torch", activation_checkpointing=self.activation_checkpointing,
                      autocast_weight_copies=True, bucket_rebuild=True)

    @property
    def parallel_dims(self) -> ParallelDims:
        """Every rank holds the whole model: the data-parallel state is replicated."""
        return ParallelDims(dp_replicate=self.world_size)

    @override
    def setup_environment(self) -> None:
        with self.forming_process_group():
            super().setup_environment()

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        weights_only = weights_only_for(checkpoint_path, weights_only)
        foreign = load_for_resume(self, checkpoint_path, native_formats={FILE}, weights_only=weights_only)
        trainer = self.lightning_module.trainer
        if foreign is not None:
            if saved_with_an_average(foreign, trainer):  # read on rank 0: the callback restores it on every rank
                foreign = whole_average_and_current(self.lightning_module, foreign, from_rank_zero=True)
            return self.read_loader_record(foreign)
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        if LEFT_OUT in checkpoint:  # a consolidated DeepSpeed checkpoint without its frozen weights: the model's
            check_left_out(self.lightning_module, checkpoint[LEFT_OUT])
            if saved_with_an_average(checkpoint, trainer):  # the callback's load is strict
                checkpoint = whole_average_and_current(self.lightning_module, checkpoint, from_rank_zero=False)
        return self.read_loader_record(checkpoint)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if checkpoint.get("state_dict") is not None and may_lack(checkpoint):
            load_around_left_out(self.lightning_module, checkpoint, strict)
        elif checkpoint.get("state_dict") is not None:
            super().load_model_state_dict(checkpoint, strict)
        # Else a foreign checkpoint consolidated on rank 0 only: DDP broadcasts rank 0's weights as it wraps the model.

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:  # type: ignore[override]  # its dict
        if "optimizer_state_by_name" in checkpoint:  # consolidated from another strategy's checkpoint
            restore_optimizer_by_name(self, self.lightning_module, self.optimizers, checkpoint)
        else:
            super().load_optimizer_state_dict(checkpoint)
