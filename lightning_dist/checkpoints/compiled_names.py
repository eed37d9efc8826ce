"""Checkpoints of a model with a compiled part (`self.model = torch.compile(self.model)` in a LightningModule) loaded
into it: torch's state dicts for sharded models name its weights without the compiled wrapper's `_orig_mod.`, and
Lightning loads a sharded checkpoint with the module's own `load_state_dict`, which wants it. Every test or resume of
such a checkpoint under ld_fsdp stopped (`Missing key(s) in state_dict: "model._orig_mod.model.embed_tokens.weight"`).
Each wrapper takes the names without it, as activation checkpointing's wrapper does for its own.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_dist._compat.torch import COMPILED_PREFIX, compiled_wrappers


def load_saved_names_into_compiled_parts(module: nn.Module) -> None:
    """Every compiled wrapper in `module` takes a state dict's names with or without `_orig_mod.` (idempotent)."""
    for wrapper in compiled_wrappers(module):
        if not getattr(wrapper, "loads_saved_names", False):
            wrapper.register_load_state_dict_pre_hook(_with_compiled_prefix)
            setattr(wrapper, "loads_saved_names", True)  # noqa: B010  # not a torch attribute: mypy reads it as one


def torch_state_dict_name(name: str) -> str:
    """`name` (a parameter's, as checkpoints name it) as torch's state-dict functions name it: a compiled part's
    weights without `_orig_mod.`."""
    return name.replace("." + COMPILED_PREFIX, ".").removeprefix(COMPILED_PREFIX)


def _with_compiled_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    for name in [name for name in state_dict if name.startswith(prefix)]:
        if not name.startswith(prefix + COMPILED_PREFIX):
            state_dict[prefix + COMPILED_PREFIX + name[len(prefix):]] = state_dict.pop(name)
