"""Which precisions each strategy trains in, per device: docs/precision.md's matrix, checked before launch.

| strategy   | 32-true | bf16-mixed                 | bf16-true | 16-mixed                                   |
|------------|---------|----------------------------|-----------|--------------------------------------------|
| ddp        | yes     | autocast, fp32 weights     | yes       | CUDA only                                  |
| fsdp       | yes     | bf16 gather, fp32 shards   | yes       | refused (no fp16 loss scaling for FSDP2)   |
| deepspeed  | yes     | bf16 weights, fp32 master  | as mixed  | CUDA, or a CPU with fp16 (DeepSpeed fp16)  |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_dist._compat.lightning import unified_precision

if TYPE_CHECKING:
    from torch import nn

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true")
FP32_WEIGHTS = ("32-true", "bf16-mixed", "16-mixed")  # the precisions whose optimizer updates fp32 weights

_NO_FP16 = "choose 32-true, bf16-mixed or bf16-true"


@dataclass(frozen=True)
class PrecisionSupport:
    """What a strategy declares (its `precision_support`) about fp16, where support differs between strategies.
    Lightning's own strategies, and any other, are taken to be like DDP: the defaults."""

    fp16_loss_scaling: bool = True  # 16-mixed works (FSDP2 has no gradient scaler for it)
    fp16_on_cpu: bool = False  # 16-bit on a CPU that has fp16 (DeepSpeed's CPU accelerator); else CUDA only
    casts_weights: bool = False  # the engine casts the module and keeps fp32 master weights itself (DeepSpeed)


def check_precision(strategy: object, precision: object, device_type: str) -> str:
    """The precision in Lightning's spelling, or ValueError naming why this strategy cannot train in it here."""
    support = getattr(strategy, "precision_support", PrecisionSupport())
    try:
        unified = str(unified_precision(precision))
    except ValueError:
        unified = str(precision)
    if unified not in PRECISIONS:
        raise ValueError(f"trainer.precision={precision}: not supported here; choose one of {', '.join(PRECISIONS)}")
    name = type(strategy).__name__
    if not support.fp16_loss_scaling and unified == "16-mixed":
        raise ValueError(
            f"trainer.precision=16-mixed: {name} (FSDP2) has no fp16 loss scaling; choose bf16-mixed or 16-true"
        )
    if unified.startswith("16-") and device_type == "cpu":
        if support.fp16_on_cpu and not fp16_supported("cpu"):
            raise ValueError(
                f"trainer.precision={unified}: DeepSpeed's CPU accelerator has no fp16 on this CPU (it needs"
                f" AVX512-FP16/AMX-FP16); {_NO_FP16}"
            )
        if not support.fp16_on_cpu:
            raise ValueError(
                f"trainer.precision={unified}: {name} has no fp16 on CPU (Lightning would silently switch to "
                "bf16-mixed);"
                f" {_NO_FP16}"
            )
    return unified


def fp16_supported(device_type: str) -> bool:
    """Whether the device computes in fp16: CUDA does; a CPU needs hardware fp16 (AVX512-FP16/AMX-FP16), as DeepSpeed's
    CPU accelerator asks."""
    if device_type == "cuda":
        return True
    from lightning_dist._compat.torch import cpu_supports_fp16

    return cpu_supports_fp16()  # the CPU accelerator's own test


def device_type(accelerator: str) -> str:
    """The device a Trainer `accelerator` flag ends up on."""
    import torch

    if accelerator in ("cuda", "gpu") or (accelerator == "auto" and torch.cuda.is_available()):
        return "cuda"
    return "cpu"


def upcast_trainable_weights(module: nn.Module, precision: str) -> list[str]:
    """Under a precision whose optimizer updates fp32 weights (`FP32_WEIGHTS`), the trainable parameters the module
    holds in bf16 or fp16, cast to fp32 in place (tied ones stay tied); their names.

    Lightning converts no module under these precisions: it takes the weights to be fp32, as torch builds them. But
    transformers (5 and later) loads a checkpoint in the dtype it was saved in, bf16 for most, and such a model was
    fine-tuned in pure bf16, its small updates rounded away (sentence-transformers#3773 and llm-foundry#1734 load in
    fp32 against it). Frozen weights (a LoRA base) stay as loaded: none of their updates is lost, and fp32 would double
    their memory."""
    import torch

    if precision not in FP32_WEIGHTS:
        return []
    names = []
    for name, parameter in module.named_parameters():  # a tied parameter is named once
        if parameter.requires_grad and parameter.dtype in (torch.bfloat16, torch.float16):
            parameter.data = parameter.data.float()
            names.append(name)
    return names


def say_upcast(precision: str, upcast: list[str]) -> None:
    """The one line a run prints where `upcast_trainable_weights` cast any."""
    if upcast:
        from lightning.pytorch.utilities.rank_zero import rank_zero_info

        rank_zero_info(f"trainer.precision={precision} updates fp32 weights: {len(upcast)} trainable parameters the"
                       " model held in 16 bits (as transformers loads a bf16 checkpoint) are cast to fp32, frozen ones"
                       " stay as loaded; trainer.precision=bf16-true trains them in bf16")
