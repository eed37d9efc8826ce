"""bitsandbytes' quantized parameters (QLoRA's 4-bit base, LLM.int8's 8-bit weights), read from its public classes.
Checked on bitsandbytes 0.50. bitsandbytes is imported only where the user's code has imported it already.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from lightning_dist._compat.fenced import Fenced

FENCED = [Fenced("bitsandbytes.nn", "Params4bit"),  # its packed data, and `quant_state` beside it
          Fenced("bitsandbytes.nn", "Int8Params"),  # its int8 data, and `SCB` (the row scales) beside it
          # Re-attaches the layer's quantization state to a weight FSDP2 gathered as a plain tensor, on each forward.
          Fenced("bitsandbytes.nn.modules", "fix_4bit_weight_quant_state_from_module", ("module",)),
          # The CPU re-layout that `keep_4bit_layout` turns off; it marks the state `packing_format_for_cpu`.
          Fenced("bitsandbytes.functional", "_convert_weight_packed_for_cpu", ("qweight", "quant_state"))]


def quantized_kind(param: Any) -> str | None:
    """"4-bit" or "8-bit" where `param` is one of bitsandbytes' quantized parameters, else None."""
    if "bitsandbytes" not in sys.modules:
        return None
    from bitsandbytes.nn import Int8Params, Params4bit

    if isinstance(param, Params4bit):
        return "4-bit"
    return "8-bit" if isinstance(param, Int8Params) else None


def keep_4bit_layout(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Turn off the CPU re-layout of each of `module`'s 4-bit layers (its `support_avx512bf16_for_cpu`, which
    `Linear4bit.forward` reads on each call); returns them, named."""
    if "bitsandbytes" not in sys.modules:
        return []
    from bitsandbytes.nn import Linear4bit

    layers = [(name, layer) for name, layer in module.named_modules() if isinstance(layer, Linear4bit)]
    for _, layer in layers:
        layer.support_avx512bf16_for_cpu = False
    return layers


def relaid_out(layer: nn.Module) -> bool:
    """Whether bitsandbytes re-laid `layer`'s 4-bit weight out for its CPU kernel (the mark it leaves in the state)."""
    states = (getattr(layer.weight, "quant_state", None), getattr(layer, "quant_state", None))  # sharded: the layer's
    return any(getattr(state, "packing_format_for_cpu", False) for state in states)
