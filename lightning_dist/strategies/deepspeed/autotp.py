"""DeepSpeed AutoTP under Lightning: the check that the ranks of a tensor-parallel group got the same batch, the sum
of a replicated layer's gradients over the group, and the engine Lightning builds for validation and testing on its
own (`trainer.test` after `fit`).

DeepSpeed checks the first forward's inputs itself, but compares them one level deep: Lightning's `(batch,
batch_idx)`, a batch being a list of tensors, fails that comparison with "Boolean value of Tensor with more than one
value is ambiguous" on every run. Ours looks at every tensor however deep, on the first batch, and fails on every
rank of the group at once when its ranks disagree (a sampler that ignores the tensor-parallel layout).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist

from lightning_dist._compat.deepspeed import (
    gradient_summed_over_group,
    replace_tensor_parallel_input_check,
    splits_as_fused_qkv,
    sum_gradient_over_group,
)
from lightning_dist._compat.lightning import remove_module_hooks
from lightning_dist._compat.torch import tree_map
from lightning_dist.parallel.tensor_parallel import (
    ROTARY_KEY_SUMMED,
    SUMMED,
    matched_modules,
    own_plan_styles,
    per_head_parameter,
    rotary_key_layers,
    sum_rotary_key_gradients,
    summed_layers,
)

# What AutoTP's name rules do to a transformers model's layers: split a projection's outputs or its inputs, with a
# sum after the second (its q/k/v and gate/up, its o and down), which the model's own plan calls colwise and rowwise.
# What they cannot do is gather a split output back or split a whole input (transformers' `colwise_gather_output`,
# `rowwise_split_input`): OLMo2's norm over every head's queries failed on its shapes, Phi-3's fused projections in
# DeepSpeed's fused-QKV code. The layers it keeps whole whose gradients are to be summed, we sum (below).
NAME_RULES_FOLLOW = ("colwise", "rowwise", SUMMED, ROTARY_KEY_SUMMED, "embedding_rowwise")

# The blocks whose fused q/k/v projection AutoTP's rules split so that 2 ranks train one rank's losses: GPT-NeoX's,
# whose heads each hold their q, k and v side by side. The rules guess the layout from the block's class name, and
# the others we tried failed in tracebacks (Falcon's and StarCoder's one key head, BLOOM's ALiBi slopes left whole,
# MPT's, CodeGen's, GPT-2's), measured 2026-12-07 with DeepSpeed 0.19.8.
FUSED_QKV_SPLIT_CHECKED = ("GPTNeoXAttention",)


class TensorParallelBatchMismatch(RuntimeError):
    pass


def check_tensor_parallel_inputs(engine: Any, device: torch.device) -> None:
    """Replaces DeepSpeed's first-forward check on `engine` (an AutoTP engine) with one that recurses."""
    from deepspeed.utils import groups

    group, source = groups.get_tensor_model_parallel_group(), groups.get_tensor_model_parallel_src_rank()

    def check(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        handle.remove()  # the first forward only, as DeepSpeed's
        tensors: list[torch.Tensor] = []
        tree_map(lambda leaf: tensors.append(leaf) if isinstance(leaf, torch.Tensor) else None, (args, kwargs))
        agree = torch.ones((), device=device)
        for tensor in tensors:
            theirs = tensor.detach().to(device).clone()
            dist.broadcast(theirs, src=source, group=group)
            if not torch.equal(theirs, tensor.detach().to(device)):
                agree.zero_()
        dist.all_reduce(agree, op=dist.ReduceOp.MIN, group=group)
        if not agree.item():
            raise TensorParallelBatchMismatch(
                "the ranks of a tensor-parallel group got different batches (DeepSpeed AutoTP needs one batch per"
                " group): give the train loader a DistributedSampler with the strategy's distributed_sampler_kwargs"
            )

    handle = replace_tensor_parallel_input_check(engine, check)


def sum_replicated_gradients(model: torch.nn.Module) -> None:
    """Sums over the tensor-parallel group the gradients of the layers that the model's own plan keeps whole with
    their gradients summed (Qwen3's q and k norms, which see each rank's own heads), and the rotary key of DeepSeek's
    latent attention. AutoTP does so for a plan it reads from `model.config`, which a LightningModule holding the
    transformers model has not: it splits by its name rules then, and those layers drifted apart (measured: Qwen3 at
    2 x 2, 3.9e-6 relative off ddp's loss at step 2, and growing; DeepSeek-V3 at 2 ranks, 3.1e-5 at step 1).
    RuntimeError if a trainable parameter of those layers was left without the sum."""
    from deepspeed.utils import groups
    from torch.distributed.device_mesh import DeviceMesh

    group = groups.get_tensor_model_parallel_group()
    if rotary := rotary_key_layers(model):  # DeepSeek's latent attention: AutoTP keeps the layer whole, as planned
        device_type = next(model.parameters()).device.type
        sum_rotary_key_gradients(model, rotary, DeviceMesh.from_group(group, device_type))
    summed = summed_layers(model)
    if summed is None:
        return
    layers = matched_modules(model, dict.fromkeys(summed[1], SUMMED))
    for layer in layers.values():
        for param in layer.parameters():
            if param.requires_grad:
                sum_gradient_over_group(param, group)
    if left := [f"{name}.{param_name}" for name, layer in layers.items()
                for param_name, param in layer.named_parameters()
                if param.requires_grad and not gradient_summed_over_group(param)]:
        raise RuntimeError(f"DeepSpeed AutoTP: {left[0]}'s gradient is not summed over the tensor-parallel ranks")


def model_refusal(model: torch.nn.Module, size: int) -> str | None:
    """Why AutoTP at `size` ranks cannot split `model` right, in one line: its own plan has styles the name rules do
    not follow (`NAME_RULES_FOLLOW`), or it has a fused q/k/v projection of a kind not checked; None otherwise."""
    styles = own_plan_styles(model)
    if styles and (others := sorted({style for style in styles[1].values() if style not in NAME_RULES_FOLLOW})):
        return (f"strategy.tensor_parallel_size={size}: {styles[0]}.tp_plan splits layers in {', '.join(others)}, which"
                " DeepSpeed AutoTP's name rules do not do (it reads no plan from a LightningModule); train it under"
                " strategy=fsdp_tp, which runs that plan, or with strategy.tensor_parallel_size=1")
    if per_head := per_head_parameter(model):
        return (f"strategy.tensor_parallel_size={size}: {per_head} holds one value per attention head, which DeepSpeed"
                " AutoTP's split of the heads leaves whole on every rank (GPT-OSS's attention sinks); train the model"
                " with strategy.tensor_parallel_size=1")
    if fused := _unchecked_fused_qkv(model, size):
        instead = f"under strategy=fsdp_tp, which runs {styles[0]}.tp_plan, or " if styles else ""
        checked = ", ".join(FUSED_QKV_SPLIT_CHECKED)
        return (f"strategy.tensor_parallel_size={size}: DeepSpeed AutoTP would split {fused} as a fused q/k/v"
                f" projection by a guess at its heads' layout, checked right only in {checked}; train it {instead}with"
                " strategy.tensor_parallel_size=1")
    return None


def _unchecked_fused_qkv(model: torch.nn.Module, size: int) -> str | None:
    """The first layer of `model` AutoTP would split as a fused q/k/v projection in a block not of
    `FUSED_QKV_SPLIT_CHECKED` (named with its block's class), or None."""
    modules = dict(model.named_modules())
    for name in modules:
        if splits_as_fused_qkv(name, size):
            block = type(modules[name.rpartition(".")[0]]).__name__
            return None if block in FUSED_QKV_SPLIT_CHECKED else f"{name} ({block})"
    return None


def is_split(model: torch.nn.Module) -> bool:
    """Whether AutoTP has replaced the model's linear layers with its own (an engine was built for it already)."""
    return any(type(module).__module__.startswith("deepspeed.module_inject") for module in model.modules())


def initialize_inference_engine(strategy: Any, model: torch.nn.Module) -> Any:
    """The engine Lightning's `_initialize_deepspeed_inference` builds (precision, and ZeRO-3's section), told the
    tensor-parallel size too: without it, an engine after training's finds DeepSpeed's tensor-parallel groups
    (process-wide) but no `mpu`, and fails. Layers that training split are not split again."""
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "tensor_parallel": strategy.config["tensor_parallel"]}
    config.update({key: strategy.config[key] for key in ("fp16", "bf16") if key in strategy.config})
    if strategy.zero_stage_3:
        config.update({key: strategy.config[key] for key in ("zero_allow_untested_optimizer", "zero_optimization")})
    if is_split(model):
        setattr(model, "ds_autotp_parsed", True)  # DeepSpeed's mark of a split model, read as an attribute
    remove_module_hooks(model)
    engine, *_ = deepspeed.initialize(args=argparse.Namespace(device_rank=strategy.root_device.index), config=config,
                                      model=model, optimizer=None, lr_scheduler=None, model_parameters=[],
                                      dist_init_required=False)
    check_tensor_parallel_inputs(engine, strategy.root_device)
    return engine
