"""A torch function mode that reroutes every call of one torch function, whatever name the caller has for it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.overrides import TorchFunctionMode


class every_call(TorchFunctionMode):  # lower case: entered as a context, as torch's own modes are
    """Within: each call of `function` (`F.scaled_dot_product_attention`, or the same function imported as `sdpa`)
    goes to `replacement`, which may call `function` itself (a mode's handler runs with the mode off). Function modes
    do not reach backward's recomputation of checkpointed blocks."""

    def __init__(self, function: Callable[..., Any], replacement: Callable[..., Any]) -> None:
        super().__init__()
        self.function, self.replacement = function, replacement

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is self.function:
            return self.replacement(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))
