"""Resuming DeepSpeed (any ZeRO stage) from a DDP or FSDP checkpoint.

The checkpoint is consolidated on rank 0 (resume.py). Parameter by parameter, rank 0 broadcasts the full tensor and
every rank keeps its part through DeepSpeed's own API for partitioned state (`deepspeed.utils.safe_set_full_*`):
the module's weight (its ZeRO-3 partition), the fp32 master weight and Adam's two moments. So no rank holds more
than one full parameter beyond its partitions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_dist._compat.deepspeed import point_parameters_at_optimizer_state
from lightning_dist._compat.lightning import attached_trainer
from lightning_dist.checkpoints.contents import left_frozen_weights_out
from lightning_dist.checkpoints.formats import CURRENT_MODEL_STATE, DEEPSPEED, CheckpointError
from lightning_dist.checkpoints.frozen_weights import may_lack
from lightning_dist.checkpoints.gather import plain_name
from lightning_dist.checkpoints.ranks import Ranks
from lightning_dist.checkpoints.resume import (
    OPTIMIZER_KEYS,
    hyper_parameters,
    load_for_resume,
    optimizer_state_by_name,
    refuse_weights_only_to_fit,
    saved_group_settings,
)
from lightning_dist.checkpoints.source import CheckpointSource, weights_only_for
from lightning_dist.strategies.deepspeed.autoep import autoep_size, local_experts
from lightning_dist.strategies.deepspeed.config.zero import ZeroSection
from lightning_dist.strategies.deepspeed.universal import (
    convert_on_rank_zero,
    loading_universal,
    saved_adam_moments,
    saved_run,
)
from lightning_dist.strategies.weight_averaging import saved_with_an_average, whole_average_and_current

_MOMENTS = ("exp_avg", "exp_avg_sq")


class DeepSpeedRanks(Ranks, Protocol):
    """The DeepSpeed strategy's ranks: its engine and its resolved config as well."""

    @property
    def deepspeed_engine(self) -> Any: ...

    @property
    def config(self) -> Any: ...


def load_into_engine(strategy: DeepSpeedRanks, checkpoint: dict[str, Any], strict: bool) -> None:
    """Rank 0's consolidated `checkpoint` (weights and optimizer state by name) into the running DeepSpeed engine."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    module, engine = strategy.lightning_module, strategy.deepspeed_engine
    names = getattr(strategy, "param_group_names", [])
    states = optimizer_state_by_name(checkpoint, names) if strategy.is_global_zero else None
    settings = strategy.broadcast(saved_group_settings(checkpoint) if strategy.is_global_zero else None)
    weights = checkpoint.pop("state_dict", None)
    for key in OPTIMIZER_KEYS:
        checkpoint.pop(key, None)
    experts = _local_experts(module)  # under AutoEP: each rank takes its own experts of every stack
    if experts and strategy.is_global_zero:
        weights, states = _in_autoep_names(weights, states, getattr(strategy, "autoep_model_names", {}))
    # Buffers a module keeps out of its state dict (transformers' rotary inv_freq) are rebuilt, never saved.
    saved = {plain_name(name) for name in module.state_dict(keep_vars=True)}
    tensors = [(plain_name(n), t) for n, t in (*module.named_parameters(), *module.named_buffers())
               if plain_name(n) in saved]
    absent = _absent_on_rank_zero(strategy, weights, [name for name, _ in tensors], strict, may_lack(checkpoint))
    optimizer = engine.optimizer if strategy.lightning_module.trainer.training else None
    adam_states = bool(states) and all("exp_avg" in state for state in (states or {}).values())
    with_moments = strategy.broadcast(adam_states and optimizer is not None)
    if optimizer is not None and not with_moments:
        rank_zero_warn("The checkpoint has no Adam state for this optimizer: it starts afresh.")
    if with_moments:
        _create_adam_state(optimizer)
    for name, tensor in tensors:
        if name in absent:
            continue
        own = experts.get(name.rsplit(".", 2)[0]) if ".experts.w" in name else None  # an AutoEP stack's
        value = _whole_or_own(strategy, weights.get(name) if weights else None, tensor, own)
        _set_weight(tensor, value)
        if isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad and optimizer is not None:
            safe_set_full_fp32_param(tensor, value.float())
            if with_moments:
                for key in _MOMENTS:
                    state = states[name][key] if states else None
                    safe_set_full_optimizer_state(tensor, _whole_or_own(strategy, state, tensor, own).float(), key)
    if with_moments:
        step = strategy.broadcast(_step_of(states or {}) if strategy.is_global_zero else 0.0)
        _set_step(optimizer, step)
    if optimizer is not None:
        for group, as_saved in zip(optimizer.param_groups, hyper_parameters(optimizer.param_groups, settings)):
            group.update(as_saved)


def engine_reads_natively(saved_config: dict[str, Any], config: dict[str, Any]) -> bool:
    """Whether DeepSpeed's own loader takes a checkpoint written under `saved_config` into an engine configured by
    `config`. It does not across ZeRO-3 and ZeRO-1/2, which write different files (a model-states file per rank, or
    one for all), nor into an offloaded optimizer (DeepSpeedCPUAdam) from a torch one, whose param groups lack its
    `bias_correction`, nor across AutoEP sizes, whose layers hold the experts by its names and each rank its share.
    Those checkpoints load like foreign ones: consolidated, then partitioned (load_into_engine).
    """
    if not saved_config:  # written by a DeepSpeed that did not record its config
        return True
    if autoep_size(saved_config) != autoep_size(config):
        return False
    saved, ours = ZeroSection.of(saved_config), ZeroSection.of(config)
    if saved.partitions_parameters != ours.partitions_parameters:
        return False
    return saved.offloads_optimizer or not ours.offloads_optimizer


def _zero3_without_optimizer(strategy: DeepSpeedRanks) -> bool:
    """ZeRO-3's engine restores its partitioned weights from a checkpoint through its optimizer's fp32 partitions. The
    engine of a `validate`, `test` or `predict` has no optimizer, and DeepSpeed's loader fails there (DeepSpeed 0.19.8:
    'DeepSpeedZeRoOffload' object has no attribute '_restore_from_bit16_weights'): consolidated instead."""
    return ZeroSection.of(strategy.config).partitions_parameters and not strategy.lightning_module.trainer.training


def _absent_on_rank_zero(strategy: Ranks, weights: dict | None, names: list[str], strict: bool,
                         left_out: set[str]) -> set[str]:
    """The names rank 0's checkpoint lacks, known on every rank; an error for any under strict loading but those it
    left out (frozen weights, checked against the model's: frozen_weights.py)."""
    absent = strategy.broadcast([n for n in names if n not in (weights or {})] if strategy.is_global_zero else [])
    lacking = [name for name in absent if name not in left_out]
    if lacking and strict:
        raise CheckpointError(
            f"ckpt_path: the checkpoint has no weights for {', '.join(lacking[:3])} (of {len(lacking)})"
        )
    return set(absent)


def _local_experts(module: torch.nn.Module) -> dict[str, list[int]]:
    return {plain_name(name): own for name, own in local_experts(module).items()}


def _in_autoep_names(weights: dict | None, states: dict | None, blocks: dict[str, Any],
                     ) -> tuple[dict | None, dict | None]:
    """Rank 0's checkpoint, in the model's names (another strategy's, or AutoEP's of another size consolidated), in
    the names of AutoEP's layers."""
    from lightning_dist.checkpoints.autoep_names import in_autoep_names

    if not weights or not blocks:
        return weights, states
    weights = in_autoep_names(weights, blocks)
    if states:
        moments = {key: in_autoep_names({n: s[key] for n, s in states.items() if key in s}, blocks) for key in _MOMENTS}
        step = next(iter(states.values())).get("step")
        states = {name: {"step": step, **{key: moments[key][name] for key in _MOMENTS}} for name in moments["exp_avg"]}
    return weights, states


def _full_shape(tensor: torch.Tensor) -> torch.Size:
    return getattr(tensor, "ds_shape", tensor.shape)  # a ZeRO-3 parameter's own shape reads (0,)


def _whole_or_own(strategy: Ranks, value: torch.Tensor | None, like: torch.Tensor, own: list[int] | None,
                  ) -> torch.Tensor:
    """Rank 0's `value` on every rank: whole, or where `own` names this rank's experts of an AutoEP stack, those."""
    if own is None:
        return _from_rank_zero(strategy, value, like)
    every_expert = strategy.broadcast(None if value is None else tuple(value.shape))
    return _from_rank_zero(strategy, value, like, every_expert)[own]


def _from_rank_zero(strategy: Ranks, value: torch.Tensor | None, like: torch.Tensor,
                    shape: tuple[int, ...] | None = None) -> torch.Tensor:
    # Collectives take tensors on the root device (nccl refuses host tensors); every rank gets the full tensor
    # (`shape` where it is not `like`'s: every expert of an AutoEP stack, of which a rank holds some).
    device = strategy.root_device
    if strategy.is_global_zero:
        assert value is not None, "rank 0 sends what its checkpoint holds"
        buffer = value.to(device=device, dtype=like.dtype).contiguous()
    else:
        buffer = torch.empty(shape or _full_shape(like), dtype=like.dtype, device=device)
    dist.broadcast(buffer, src=0)
    return buffer


def _set_weight(tensor: torch.Tensor, value: torch.Tensor) -> None:
    if hasattr(tensor, "ds_id"):  # a ZeRO-3 partition: gather, set on rank 0, and partition again from there
        import deepspeed

        # Rank 0 of the parameter's own group (an AutoEP expert's: the ranks that hold those experts).
        with deepspeed.zero.GatheredParameters([tensor], modifier_rank=0):
            if dist.get_rank(group=getattr(tensor, "ds_process_group", None)) == 0:
                tensor.data.copy_(value.view(_full_shape(tensor)))
        return
    with torch.no_grad():
        tensor.copy_(value.to(tensor.device))


def _create_adam_state(optimizer: Any) -> None:
    """Adam creates its moments at its first step, and DeepSpeed's setters write into them: create them now, zero,
    for each flat fp32 partition the base optimizer steps (ZeRO-3 hands it one sub-group at a time)."""
    base = optimizer.optimizer
    partitions = getattr(optimizer, "fp32_partitioned_groups_flat", None) or [
        p for group in base.param_groups for p in group["params"]
    ]
    # DeepSpeed's own Adam kernels count steps in a plain int; torch's Adam in a tensor.
    counts_in_int = type(base).__module__.startswith("deepspeed")
    for partition in partitions:
        state = base.state[partition]
        if "exp_avg" not in state:
            state["step"] = 0 if counts_in_int else torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(partition)
            state["exp_avg_sq"] = torch.zeros_like(partition)
    point_parameters_at_optimizer_state(optimizer)


def _step_of(states: dict[str, dict[str, Any]]) -> float:
    step = next(iter(states.values()))["step"]
    return float(step)


def _set_step(optimizer: Any, step: float) -> None:
    """Adam's step count on every state of the base optimizer (ZeRO keeps one per flat partition), and on its
    parameter groups where the optimizer counts there (DeepSpeed's FusedAdam)."""
    base = optimizer.optimizer
    for state in base.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"].fill_(step)
        elif "step" in state:
            state["step"] = int(step)
    if type(base).__name__ == "FusedAdam":
        for group in base.param_groups:
            group["step"] = int(step)


def load_deepspeed_checkpoint(strategy: DeepSpeedRanks, checkpoint_path: Any, weights_only: bool | None,
                              load_natively: Callable[[Any, bool | None], dict[str, Any]]) -> dict[str, Any]:
    """The checkpoint loader of our DeepSpeed strategy: a DeepSpeed directory that the engine reads as it is goes to
    `load_natively` (Lightning's loader); one written by another number of ranks is converted to DeepSpeed's
    universal form first; anything else (DDP, FSDP, another ZeRO layout) is consolidated on rank 0 and partitioned."""
    source = CheckpointSource.of(strategy.broadcast(checkpoint_path), trusted=weights_only is False)
    weights_only = weights_only_for(source.path, weights_only)
    checkpoint_path = str(source.path)  # what DeepSpeed and Lightning read
    refuse_weights_only_to_fit(strategy, source)
    native = source.format == DEEPSPEED
    if native:
        source = source.vet()  # DeepSpeed unpickles its shards with weights_only=False
        saved_world_size, saved_config = saved_run(source)
        native = engine_reads_natively(saved_config, strategy.config) and not _zero3_without_optimizer(strategy)
        # DeepSpeed's loader would find the frozen weights missing: consolidated, the rest is loaded around them.
        native = native and not left_frozen_weights_out(source)
        # At another world size the engine reads DeepSpeed's universal form, which holds Adam's moments only.
        native = native and (saved_world_size in (None, strategy.world_size) or saved_adam_moments(source))
    if not native:
        checkpoint = load_for_resume(strategy, source, native_formats=set(), weights_only=weights_only)
        assert checkpoint is not None  # no format is native to this call: every one is consolidated
        module = strategy.lightning_module
        if saved_with_an_average(checkpoint, attached_trainer(module)):  # the engine trains on the model's own
            average = checkpoint.get("state_dict")
            checkpoint["state_dict"] = checkpoint.get(CURRENT_MODEL_STATE)
            load_into_engine(strategy, checkpoint, strict=module.strict_loading)
            # and the callback restores both, on every rank (rank 0 alone read them)
            return whole_average_and_current(module, {**checkpoint, "state_dict": average}, from_rank_zero=True)
        load_into_engine(strategy, checkpoint, strict=module.strict_loading)
        return checkpoint
    if saved_world_size in (None, strategy.world_size):
        return load_natively(checkpoint_path, weights_only)
    convert_on_rank_zero(strategy, checkpoint_path)
    with loading_universal(strategy.deepspeed_engine, checkpoint_path):
        return load_natively(checkpoint_path, weights_only)
