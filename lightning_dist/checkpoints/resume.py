"""Resuming from a checkpoint that another strategy (or world size) wrote.

Only global rank 0 reads and consolidates it: the weights and Adam state reach the other ranks by broadcast, each
rank keeping its shard (FSDP) or its replica (DDP), so a model that fits only when sharded resumes without a full
copy on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

from lightning_dist._compat.lightning import unwrapped_optimizer
from lightning_dist.checkpoints.compiled_names import torch_state_dict_name
from lightning_dist.checkpoints.consolidate import GROUP_SETTINGS, load_consolidated
from lightning_dist.checkpoints.contents import saved_weights_only, weights_only_refusal
from lightning_dist.checkpoints.formats import CURRENT_MODEL_STATE, CheckpointError
from lightning_dist.checkpoints.frozen_weights import LEFT_OUT, check_left_out, may_lack
from lightning_dist.checkpoints.gather import plain_name
from lightning_dist.checkpoints.ranks import Ranks
from lightning_dist.checkpoints.source import CheckpointSource

# The tensors of a consolidated checkpoint: read on rank 0 only, then broadcast as they are loaded.
OPTIMIZER_KEYS = ("optimizer_state_by_name", "optimizer_states")
_TENSOR_KEYS = ("state_dict", CURRENT_MODEL_STATE, *OPTIMIZER_KEYS)
_FROM_RANK_ZERO = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
_WHOLE_ON_EVERY_RANK = StateDictOptions(full_state_dict=True)


def load_for_resume(
    strategy: Ranks, path: str | Path | CheckpointSource, native_formats: set[str], weights_only: bool | None
) -> dict[str, Any] | None:
    """None when `path` is in one of the strategy's own formats (let it load as usual, once vetted); otherwise
    the checkpoint consolidated into one plain dict: on rank 0 with its weights and optimizer state by parameter
    name, on the other ranks with None in their place. A failure on rank 0 is raised on every rank.

    `weights_only` is Lightning's: unless the user passed False, every pickle in the checkpoint must hold data
    only (safe_load.py), whichever library reads it afterwards.
    """
    source = CheckpointSource.of(path, trusted=weights_only is False)
    refuse_weights_only_to_fit(strategy, source)
    if source.format in native_formats:
        source.vet()
        return None
    checkpoint: dict[str, Any] | None = None
    shared: Any = None  # rank 0's checkpoint without its tensors, or its error
    if strategy.is_global_zero:
        try:
            checkpoint = load_consolidated(source)
            shared = {k: (None if k in _TENSOR_KEYS else v) for k, v in checkpoint.items()}
        except CheckpointError as error:
            shared = error
    shared = strategy.broadcast(shared)
    if isinstance(shared, Exception):
        raise shared
    if LEFT_OUT in shared:  # weights the checkpoint does not hold: the model as built must hold them, as saved
        check_left_out(strategy.lightning_module, shared[LEFT_OUT])
    return checkpoint if strategy.is_global_zero else shared


def refuse_weights_only_to_fit(strategy: Any, source: CheckpointSource) -> None:
    """A CheckpointError where `trainer.fit` resumes from a checkpoint saved with `save_weights_only=True` (a test
    reads its weights as any other): Lightning stopped at the optimizer's restore, and FSDP's reader before it with
    `Missing key in checkpoint state_dict: optimizer_0.state...`."""
    module = getattr(strategy, "lightning_module", None)
    if module is None or module.trainer.state.fn != TrainerFn.FITTING:
        return
    if saved_weights_only(source):
        raise CheckpointError(weights_only_refusal(source.path, "trainer.test(model, ckpt_path=...)"))


def load_weights_from_rank_zero(module: torch.nn.Module, checkpoint: dict[str, Any], strict: bool,
                                partial: Ranks | None = None) -> None:
    """Rank 0's full `state_dict` into `module` on every rank, tensor by tensor (FSDP shards keep their part).
    `partial`: each rank holds part of the model (pipeline stages), rank 0's not the whole: each rank takes the
    names it holds, and under `strict` every one of them must be in the checkpoint."""
    # Torch's state-dict functions name a compiled part's weights without `_orig_mod.`, which ld_ddp's files hold
    as_saved = checkpoint.pop("state_dict", None) or {}
    state_dict = {torch_state_dict_name(name): value for name, value in as_saved.items()}
    # checked (load_for_resume): each rank keeps its part of them as it is
    left_out = {torch_state_dict_name(name) for name in may_lack(checkpoint)}
    if left_out and partial is None and strict:
        _check_holds_the_rest(module, state_dict, left_out)
    if partial is not None:
        names: list[str] | None = sorted(state_dict) if partial.is_global_zero else None
        saved = set(partial.broadcast(names) or ())
        missing = sorted({torch_state_dict_name(name) for name in module.state_dict()} - saved - left_out)
        everyones: list[Any] = [None] * partial.world_size
        torch.distributed.all_gather_object(everyones, missing)
        missing = [name for names in everyones for name in names]
        if strict and missing:
            raise CheckpointError(f"ckpt_path: the checkpoint has no {', '.join(sorted(set(missing))[:3])}")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                               strict=strict and partial is None and not left_out)
    set_model_state_dict(module, state_dict, options=options)


def _check_holds_the_rest(module: torch.nn.Module, state_dict: dict[str, Any], left_out: set[str]) -> None:
    """A CheckpointError on every rank where rank 0's weights lack any but the `left_out` ones."""
    held = {torch_state_dict_name(plain_name(name)) for name in module.state_dict()}
    missing = [sorted(held - set(state_dict) - left_out) if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(missing, src=0)
    if missing[0]:
        raise CheckpointError(f"ckpt_path: the checkpoint has no {', '.join(missing[0][:3])}")


def group_names(module: torch.nn.Module, param_groups: list[dict[str, Any]]) -> list[list[str]]:
    """The parameter names of each optimizer parameter group, as checkpoints name them."""
    names = {id(p): plain_name(name) for name, p in module.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in param_groups]


def optimizer_state_by_name(checkpoint: dict[str, Any], groups: list[list[str]]) -> dict[str, dict] | None:
    """Per-parameter-name optimizer state: consolidated already (another strategy's checkpoint), or the single
    optimizer state of a plain file, keyed by name (FSDP wrote it) or by position in the parameter groups (DDP
    did: mapped onto `groups`, the names of this optimizer's groups, which must have the same sizes)."""
    if checkpoint.get("optimizer_state_by_name"):
        return checkpoint["optimizer_state_by_name"]
    saved = checkpoint.get("optimizer_states") or []
    if len(saved) != 1:
        return None
    state, saved_groups = saved[0]["state"], saved[0]["param_groups"]
    if all(isinstance(key, str) for key in state):
        return state
    if [len(g["params"]) for g in saved_groups] != [len(names) for names in groups]:
        return None
    return {
        name: state[index]
        for group, names in zip(saved_groups, groups) for index, name in zip(group["params"], names) if index in state
    }


def saved_group_settings(checkpoint: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The saved optimizer's parameter groups without their parameters (consolidated, or a plain file's single
    optimizer), or None where the checkpoint does not say."""
    if checkpoint.get(GROUP_SETTINGS) is not None:
        return checkpoint[GROUP_SETTINGS]
    saved = checkpoint.get("optimizer_states") or []
    if len(saved) != 1:
        return None
    return [{key: value for key, value in group.items() if key != "params"} for group in saved[0]["param_groups"]]


def hyper_parameters(live: list[dict[str, Any]], saved: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """For each live parameter group, the numbers among its settings as the checkpoint saved them: the learning
    rate a schedule had set for the next step, betas, eps, weight decay. The implementation's switches (`foreach`,
    `fused`, ...) stay this run's, as does every group where the checkpoint has another number of groups.

    A learning-rate schedule restored from its state does not set the groups' rates until its next step: without
    these, the first step after a resume from another engine's checkpoint ran at the rate the schedule starts
    with (a warmup's 0)."""
    if saved is None or len(saved) != len(live):
        return [{} for _ in live]
    return [{key: value for key, value in old.items() if key in group and _number(value)}
            for group, old in zip(live, saved)]


def _number(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return bool(value) and all(_number(item) for item in value)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def restore_optimizer_by_name(
    strategy: Ranks, module: torch.nn.Module, optimizers: list, checkpoint: dict[str, Any],
    whole_model_groups: Callable[[list[list[str]]], list[list[str]]] | None = None,
    aliases: dict[str, str] | None = None,
) -> None:
    """Load rank 0's per-parameter-name optimizer state (from `load_for_resume`) into the live optimizer on every
    rank, whatever its parameter groups or sharding: torch's state-dict API maps names onto plain and FSDP2
    parameters alike, and broadcasts one tensor at a time. Where each rank holds part of the model (pipeline
    stages), `whole_model_groups` turns this rank's group names into the whole model's (a collective), and
    `aliases` names the copies of a tied parameter, which take the state of the name it has in the whole model."""
    optimizer = unwrapped_optimizer(optimizers[0]) if len(optimizers) == 1 else None
    names = _torch_names(group_names(module, optimizer.param_groups)) if optimizer is not None else []
    if whole_model_groups is not None:
        names = whole_model_groups(names)
    state_by_name = optimizer_state_by_name(checkpoint, names) if strategy.is_global_zero and optimizer else None
    if state_by_name:  # saved by torch's state-dict functions, or from the module's own names
        state_by_name = {torch_state_dict_name(name): value for name, value in state_by_name.items()}
    settings = strategy.broadcast(saved_group_settings(checkpoint) if strategy.is_global_zero else None)
    if state_by_name and aliases:
        aliases = {torch_state_dict_name(alias): torch_state_dict_name(name) for alias, name in aliases.items()}
        state_by_name = {**state_by_name, **{alias: state_by_name[name] for alias, name in aliases.items()
                                             if name in state_by_name and alias not in state_by_name}}
        names = [group + [alias for alias, name in aliases.items() if name in group] for group in names]
    for key in OPTIMIZER_KEYS:
        checkpoint.pop(key, None)
    mapped = strategy.broadcast(None if state_by_name is None else bool(state_by_name))  # None: cannot be mapped
    if not mapped:
        if optimizer is not None:  # nothing saved to map (plain SGD keeps no state): the groups' settings still
            for group, as_saved in zip(optimizer.param_groups, hyper_parameters(optimizer.param_groups, settings)):
                group.update(as_saved)
        if mapped is None:
            rank_zero_warn("The checkpoint's optimizer state cannot be mapped onto this optimizer: it starts afresh.")
        return
    assert optimizer is not None  # rank 0 mapped its state, and every rank has the same optimizers
    saved = hyper_parameters(optimizer.param_groups, settings)
    groups = [{**group, **old, "params": params} for group, old, params in zip(optimizer.param_groups, saved, names)]
    # A frozen parameter in the optimizer's groups (a LoRA base, as `AdamW(self.parameters())` passes it) never has
    # state: torch's optimizers make none without a gradient, and DeepSpeed's leave it out of their groups.
    frozen = {torch_state_dict_name(plain_name(name)) for name, p in module.named_parameters() if not p.requires_grad}
    missing = None
    if strategy.is_global_zero:
        assert state_by_name is not None
        missing = [name for group in groups for name in group["params"]
                   if name not in state_by_name and name not in frozen]
    missing = strategy.broadcast(missing)
    if missing:
        raise CheckpointError(f"ckpt_path: the checkpoint has no optimizer state for {', '.join(missing[:3])}")
    full: dict[str, Any] = {}
    if strategy.is_global_zero:
        assert state_by_name is not None
        full = {
            "state": {name: state_by_name[name] for group in groups for name in group["params"]
                      if name in state_by_name},
            "param_groups": groups,
        }
    if whole_model_groups is not None:
        full = _own_part(strategy, module, optimizer, full)
    set_optimizer_state_dict(module, optimizer, optim_state_dict=full,
                             options=_FROM_RANK_ZERO if whole_model_groups is None else _WHOLE_ON_EVERY_RANK)


def _torch_names(groups: list[list[str]]) -> list[list[str]]:
    """Parameter names as torch's state-dict functions name them, which the optimizer state is loaded with and which
    a sharded checkpoint saved it under: a compiled part's without `_orig_mod.` (ld_ddp resuming ld_fsdp's
    checkpoint of a compiled module stopped: "the checkpoint has no optimizer state for model._orig_mod...")."""
    return [[torch_state_dict_name(name) for name in group] for group in groups]


def _own_part(strategy: Ranks, module: torch.nn.Module, optimizer: Any, full: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's whole-model optimizer state, sent parameter by parameter; each rank keeps the parameters it holds,
    under its own groups. (torch's broadcast from rank 0 would give every rank rank 0's groups, which are the
    whole model's, and map them onto a stage's parameters by position.)"""
    own = _torch_names(group_names(module, optimizer.param_groups))
    held = {name for group in own for name in group}
    state: dict[str, Any] = {}
    for name in strategy.broadcast(list(full["state"]) if strategy.is_global_zero else None) or []:
        value = strategy.broadcast(full["state"][name] if strategy.is_global_zero else None)
        if name in held:
            state[name] = value
    settings = strategy.broadcast([{key: value for key, value in group.items() if key != "params"}
                                   for group in full["param_groups"]] if strategy.is_global_zero else None) or []
    return {"state": state, "param_groups": [{**group, "params": names} for group, names in zip(settings, own)]}


def drop_group_keys_not_saved(optimizers: list[torch.optim.Optimizer], path: str | Path) -> None:
    """Before a sharded checkpoint (DCP's) loads into `optimizers`: each param group's settings it does not hold
    removed, as Lightning's ddp load leaves them (the saved groups replace the groups). DCP wants every key of the
    state it loads into, and stopped at a setting added since the save: `Missing key in checkpoint state_dict:
    optimizer_0.param_groups.0.initial_lr`, which every torch scheduler made after the save adds, `Tuner.lr_find`'s
    included (it saves, searches, then restores the save). A group the checkpoint holds nothing of is left whole."""
    from torch.distributed.checkpoint import FileSystemReader

    saved = set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    for index, optimizer in enumerate(optimizers):
        for number, group in enumerate(unwrapped_optimizer(optimizer).param_groups):
            prefix = f"optimizer_{index}.param_groups.{number}."
            if f"{prefix}params" in saved:
                for key in [key for key in group if key != "params" and prefix + key not in saved]:
                    del group[key]
