"""What PEFT's tuner layers are, read from PEFT's own classes. Checked on peft 0.21.

A tuner layer (LoRA's `lora.Linear`, ...) keeps its adapters in the attributes its class names
(`adapter_layer_names`, `other_param_names`: public class attributes). peft is imported only where the user's code
has imported it already.
"""

from __future__ import annotations

import sys
from typing import Any

from lightning_dist._compat.fenced import Fenced

FENCED = [Fenced("peft.tuners.tuners_utils", "BaseTunerLayer.adapter_layer_names"),
          Fenced("peft.tuners.tuners_utils", "BaseTunerLayer.other_param_names"),
          Fenced("peft.tuners.lora", "Linear"),  # LoRA's linear layer: its base_layer, lora_A and lora_B
          # LoRA on one parameter of its module (target_parameters: a mixture of experts' 3-D ones)
          Fenced("peft.tuners.lora", "ParamWrapper.get_delta_factors", ("self", "adapter_name")),
          Fenced("peft.tuners.lora", "ParamWrapper.get_param", ("self",))]


# Where a tuner layer holds the layer it tunes (`BaseTunerLayer.get_base_layer`): a name the base model lacks.
TUNED_LAYER = "base_layer"


def imported() -> bool:
    return "peft" in sys.modules


def is_tuner_layer(module: Any) -> bool:
    """Whether `module` is one of PEFT's tuner layers (False where peft was never imported)."""
    if not imported():
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer

    return isinstance(module, BaseTunerLayer)


def adapter_names(module: Any) -> tuple[str, ...]:
    """The attributes of a PEFT tuner layer that hold its adapters (LoRA's `lora_A`, `lora_B`, ...)."""
    return tuple(module.adapter_layer_names) + tuple(getattr(module, "other_param_names", ()))


def adapter_cast_dtype(tuner: Any) -> Any:
    """The dtype PEFT moves a new adapter of `tuner` to as it builds it: its base layer's weight's, where that is a
    float dtype (`BaseTunerLayer._move_adapter_to_device_of_base_layer`); None where it keeps the adapter's own (a
    quantized base). PEFT then makes a 16-bit adapter float32 again (`autocast_adapter_dtype`): its values are those
    drawn in float32, rounded to the base's dtype. A `ParamWrapper` (LoRA on a parameter, `target_parameters`: a
    mixture of experts' fused experts) moves it to that parameter's dtype."""
    from peft.tuners.lora import ParamWrapper
    from torch import nn

    if isinstance(tuner, ParamWrapper):
        dtype = tuner.get_param().dtype
    else:
        base = tuner.get_base_layer()
        if isinstance(base, nn.MultiheadAttention):
            base = base.out_proj
        dtype = getattr(getattr(base, "weight", None), "dtype", None)
    return dtype if dtype is not None and (dtype.is_floating_point or dtype.is_complex) else None


def lora_linear_factors(module: Any) -> tuple[list[str], list[str]] | None:
    """For LoRA's plain `lora.Linear` (no DoRA magnitude), the names (relative to it) of its adapters' down factors
    (`lora_A.<adapter>`, in -> r) and up factors (`lora_B.<adapter>`, r -> out); None for any other module, DoRA and
    other tuners included."""
    if not imported():
        return None
    from peft.tuners.lora import Linear

    if type(module) is not Linear or len(getattr(module, "lora_magnitude_vector", ())):
        return None
    return [f"lora_A.{name}" for name in module.lora_A], [f"lora_B.{name}" for name in module.lora_B]


def parameter_adapters(model: Any, name: str) -> list[Any]:
    """PEFT's LoRA wrappers (`ParamWrapper`, of `target_parameters`) around the module `name` of `model`, outermost
    first: PEFT wraps a module once per parameter it adapts, each wrapper's `base_layer` the next. Empty where there
    are none (or peft was never imported)."""
    if not imported():
        return []
    from peft.tuners.lora import ParamWrapper

    wrappers = []
    while name.endswith(f".{TUNED_LAYER}"):
        name = name.removesuffix(f".{TUNED_LAYER}")
        module = model.get_submodule(name)
        if not isinstance(module, ParamWrapper):
            break
        wrappers.append(module)
    return wrappers[::-1]


def active_expert_factors(wrapper: Any, experts: slice) -> list[tuple[Any, Any, float]]:
    """`(lhs, rhs, scaling)` of each of `wrapper`'s active adapters, for `experts` only (slices of its 3-D
    parameter's first dimension): the delta of those experts' weights is `scaling * lhs @ rhs`, as PEFT adds it
    (`ParamWrapper.get_delta_factors`, whose factors are views of the adapters' weights: a slice of them carries
    the gradient of those experts' rows and columns alone). Empty while its adapters are disabled."""
    if wrapper.disable_adapters:
        return []
    factors = []
    for adapter in wrapper.active_adapters:
        if adapter in wrapper.lora_A:
            lhs, rhs, scaling = wrapper.get_delta_factors(adapter)
            factors.append((lhs[experts], rhs[experts], scaling))
    return factors


def run_base_layer_only(wrapper: Any) -> None:
    """`wrapper` (a `ParamWrapper`) calls its base layer and nothing else: its own forward adds its adapters' delta
    for every expert to the whole parameter (a parametrization for the call), where expert parallelism holds a
    rank's experts' slice and adds theirs itself (parallel/expert_parallel/layers.py). An instance attribute, as
    FSDP2's class swap keeps it."""
    base_layer = getattr(wrapper, TUNED_LAYER)

    def forward(x: Any, *args: Any, **kwargs: Any) -> Any:
        return base_layer(x, *args, **kwargs)

    wrapper.forward = forward
