"""DDP's failure when a step leaves parameters without gradients, said with their names and this package's fix.

torch's reducer waits for every trainable parameter's gradient; a parameter no loss used (a GAN's generator in the
discriminator's step, a layer the forward skips) stops the next step with "Expected to have finished reduction in
the prior iteration", naming the parameters by index. Lightning replaces that with a message that names neither
them nor this strategy: its `strategy='ddp_find_unused_parameters_true'` is Lightning's own DDP, not ours.
"""

from __future__ import annotations

import re

from torch import nn

_UNFINISHED = "Expected to have finished reduction in the prior iteration"
_INDICES = re.compile(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)")
_SHOWN = 3


def unused_parameters_message(error: BaseException, module: nn.Module) -> str | None:
    """The line that says which parameters of `module` (the one DDP wraps) had no gradient and what to do, where
    `error` is DDP's unfinished reduction; else None."""
    text = " ".join(str(arg) for arg in error.args)
    if _UNFINISHED not in text:
        return None
    # DDP numbers the parameters it reduces: the trainable ones, in the module's order, each once.
    trainable = [name for name, parameter in module.named_parameters() if parameter.requires_grad]
    found = _INDICES.search(text)
    names = [trainable[int(index)] for index in found.group(1).split()] if found else []
    which = ", ".join(names[:_SHOWN]) + (f" (and {len(names) - _SHOWN} more)" if len(names) > _SHOWN else "")
    return (
        f"DDP: {which or 'parameters (torch did not say which)'} got no gradient in the step's last backward, and DDP"
        " waits for every trainable parameter's: train with lightning_dist.DDPStrategy(find_unused_parameters=True)"
        " (train.py: +strategy.find_unused_parameters=true), or freeze them (requires_grad=False)"
    )
