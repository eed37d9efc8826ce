"""bitsandbytes' quantized parameters (QLoRA's 4-bit base, LLM.int8's 8-bit weights), read from its public classes.
Checked on bitsandbytes 0.50. bitsandbytes is imported only where the user's code has imported it already.
"""

from __future__ import annotations

import sys
from typing import Any

from lightning_dist._compat.fenced import Fenced

FENCED = [Fenced("bitsandbytes.nn", "Params4bit"),  # its packed data, and `quant_state` beside it
          Fenced("bitsandbytes.nn", "Int8Params")]  # its int8 data, and `SCB` (the row scales) beside it


def quantized_kind(param: Any) -> str | None:
    """"4-bit" or "8-bit" where `param` is one of bitsandbytes' quantized parameters, else None."""
    if "bitsandbytes" not in sys.modules:
        return None
    from bitsandbytes.nn import Int8Params, Params4bit

    if isinstance(param, Params4bit):
        return "4-bit"
    return "8-bit" if isinstance(param, Int8Params) else None
