"""Lightning's weight averaging (`WeightAveraging`, `EMAWeightAveraging`) over FSDP2's shards.

Lightning's callback copies the whole model in its `setup`, before the strategy shards it (a model built on the meta
device cannot be copied there; one built in `configure_model` is built eagerly for the copy, outside the strategy's
context), and then averages the copy's tensors with the model's after each step: under FSDP2 those are DTensors and
the first update stopped the run. The average is elementwise, so each rank can average its own shards: here the
average is a module of DTensors laid out as the model's parameters (each rank holds its shards, and an update is no
collective), put in the callback's place once the strategy has sharded the model. The callback's own code does the
rest as under DDP: it swaps the average in for validation, copies it into the model when training ends, and saves
it as the checkpoint's `state_dict` (the model's own weights as `current_model_state`), which the strategy writes as
it writes the model's: shard by shard, or gathered into one file.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import AveragedModel

from lightning_dist._compat.lightning import averaging_arguments, give_average_model
from lightning_dist.checkpoints.compiled_names import torch_state_dict_name
from lightning_dist.checkpoints.formats import CURRENT_MODEL_STATE
from lightning_dist.checkpoints.gather import plain_name
from lightning_dist.strategies.weight_averaging import weight_averaging_callbacks


class ShardedAverages:
    """The strategy's part: each WeightAveraging callback's fit `setup` taken over (`take_over`, before the setup
    hooks run), and its average built over the sharded model (`build`, once the model is sharded)."""

    def __init__(self) -> None:
        self._callbacks: list[Any] = []
        self._set_up: set[int] = set()  # the callbacks whose fit `setup` Lightning called since `take_over`

    def take_over(self, trainer: Any) -> None:
        """Every rank, before Lightning's setup hooks: each callback's fit `setup` records that it was called and
        builds nothing (its copy would be the whole model, made before sharding); its hooks that pair the model's
        parameters with the copy's find the model resharded (after an evaluation's forward FSDP2 leaves the root
        module's parameters gathered, plain tensors: the swap back after validation stopped the run)."""
        self._callbacks, self._set_up = weight_averaging_callbacks(trainer), set()
        for callback in self._callbacks:
            own = type(callback)

            def setup(trainer: Any, pl_module: Any, stage: str, callback: Any = callback, own: Any = own) -> None:
                if stage != "fit":
                    return own.setup(callback, trainer, pl_module, stage)
                self._set_up.add(id(callback))

            callback.setup = setup
            for hook in ("on_validation_epoch_start", "on_validation_epoch_end", "on_train_end"):
                setattr(callback, hook, _resharded_first(callback, getattr(own, hook)))

    def build(self, module: nn.Module) -> None:
        """Every rank, once `module` (the LightningModule) is sharded, when fitting: each callback's average, its
        shards on the callback's device (unset: each where the model's shard is). A callback whose fit `setup` did
        not come through `take_over` stops the run in one line: it would have copied the model itself."""
        for callback in self._callbacks:
            if id(callback) not in self._set_up:
                raise RuntimeError(f"{type(callback).__name__}: its setup for the fit did not run as lightning-dist"
                                   " took it over (it would copy the whole model); this Lightning is not one"
                                   " lightning-dist supports")
            device, use_buffers, arguments = averaging_arguments(callback)
            give_average_model(callback, ShardedAveragedModel(module, device, use_buffers, **arguments))


def gathered_average(checkpoint: dict[str, Any], keep: bool) -> dict[str, Any]:
    """`checkpoint` with the average's shards (its `state_dict`, as the callback left it) gathered whole onto the
    host, kept where `keep` (the rank that writes the one file), tensor by tensor. A collective: every rank saves."""
    weights = checkpoint.get("state_dict")
    if not isinstance(weights, dict) or not any(isinstance(value, DTensor) for value in weights.values()):
        return checkpoint
    whole = {}
    for name, value in weights.items():  # in the same order on every rank: each DTensor is an all-gather
        value = _on_mesh_device(value).full_tensor() if isinstance(value, DTensor) else value.clone()
        if keep:
            whole[name] = value.detach().cpu()
    return {**checkpoint, "state_dict": whole}


def _on_mesh_device(value: DTensor) -> DTensor:
    """`value` with its shard on its mesh's device: an average kept in host memory (`device="cpu"`, or beside a
    CPU-offloaded model) gathers over a GPU's collectives (nccl takes no host tensor)."""
    local = value.to_local()
    if local.device.type == value.device_mesh.device_type:
        return value
    return DTensor.from_local(local.to(value.device_mesh.device_type), value.device_mesh, value.placements,
                              run_check=False, shape=value.shape, stride=value.stride())


def sharded_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of `model`'s state dict, as checkpoints name it, each weight laid out as the model's (DTensors)."""
    return {name: value.detach().clone() for name, value in _state_dict(model).items()}


def read_current_weights(model: nn.Module, path: Any) -> dict[str, torch.Tensor]:
    """The model's own weights saved beside their average in the sharded checkpoint at `path`, read into shards laid
    out as `model`'s (a collective)."""
    from torch.distributed.checkpoint import load

    current = {name: torch.empty_like(value) for name, value in _state_dict(model).items()}
    load({CURRENT_MODEL_STATE: current}, checkpoint_id=path)
    return current


def _state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s state dict as checkpoints name it (FSDP2's shards: DTensors)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)  # type: ignore[return-value]  # a module's: tensors only


def _reshard(model: nn.Module) -> None:
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def _resharded_first(callback: Any, hook: Any) -> Any:
    def resharded_first(trainer: Any, pl_module: nn.Module) -> Any:
        _reshard(pl_module)
        return hook(callback, trainer, pl_module)

    return resharded_first


class ShardedAveragedModel(AveragedModel):
    """torch's AveragedModel over a sharded model: `module` holds a copy of each shard (DTensors, named as the
    model's checkpoint names them), and `update_parameters` averages each rank's shards with the model's, with the
    callback's averaging function, as AveragedModel averages whole tensors."""

    def __init__(self, model: nn.Module, device: torch.device | int | None, use_buffers: bool, **arguments: Any):
        super().__init__(nn.Module(), use_buffers=use_buffers, **arguments)  # copies nothing: the copy is below
        self.module = _copy_of(model, None if device is None else torch.device(device))
        _check_names(model, self.module)

    def update_parameters(self, model: nn.Module) -> None:
        _reshard(model)  # each parameter its shard
        with self._local_shards():
            super().update_parameters(_LocalShards(model.parameters(), model.buffers()))

    @contextmanager
    def _local_shards(self) -> Iterator[None]:
        """Meanwhile `self.module` is this rank's shards of the copy as plain tensors (the same storage)."""
        copy = self.module
        self.module = _LocalShards(copy.parameters(), copy.buffers())
        try:
            yield
        finally:
            self.module = copy


class _LocalShards(nn.Module):
    """Parameters and buffers as this rank's plain tensors (the same storage), in their order."""

    def __init__(self, parameters: Iterable[torch.Tensor], buffers: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.shards = nn.ParameterList([nn.Parameter(_local(p), requires_grad=False) for p in parameters])
        for index, buffer in enumerate(buffers):
            self.register_buffer(f"buffer{index}", _local(buffer))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _copy_of(model: nn.Module, device: torch.device | None) -> nn.Module:
    """A module holding a copy of each of `model`'s parameters and buffers, under its checkpoint name (a tied weight
    under each of its names, one copy), in `model`'s order: `parameters()` and `buffers()` of the two pair up."""
    copy = nn.Module()
    copies: dict[int, torch.Tensor] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) not in copies:
            copies[id(parameter)] = nn.Parameter(_cloned(parameter, device), requires_grad=False)
        owner, leaf = _owner(copy, _saved_name(name))
        owner.register_parameter(leaf, copies[id(parameter)])  # type: ignore[arg-type]
    persistent = {_saved_name(name) for name in model.state_dict()}
    for name, buffer in model.named_buffers(remove_duplicate=False):
        if id(buffer) not in copies:
            copies[id(buffer)] = _cloned(buffer, device)
        owner, leaf = _owner(copy, _saved_name(name))
        owner.register_buffer(leaf, copies[id(buffer)], persistent=_saved_name(name) in persistent)
    _check_pairs(model, copy)
    return copy


def _check_names(model: nn.Module, copy: nn.Module) -> None:
    """The copy's state dict is saved as the model's `state_dict` (Lightning's callback puts it there): a
    RuntimeError where its names are not the ones the model's checkpoints hold."""
    saved, copied = set(_state_dict(model)), set(copy.state_dict())
    if saved != copied:
        name = sorted(copied - saved or saved - copied)[0]
        raise RuntimeError(f"the weight average's copy of the model names {name} otherwise than the model's"
                           " checkpoints: a checkpoint of the average would not load")


def _saved_name(name: str) -> str:
    """`name` as checkpoints name it (torch's state dicts for sharded models): without the wrappers activation
    checkpointing and `torch.compile` put into a module's names."""
    return torch_state_dict_name(plain_name(name))


def _cloned(tensor: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A copy of `tensor` (a DTensor: of this rank's shard, laid out as the original) on `device` (None: where it
    is)."""
    tensor = tensor.detach()
    if not isinstance(tensor, DTensor):
        return tensor.clone() if device is None else tensor.to(device, copy=True)
    local = tensor.to_local()
    local = local.clone() if device is None else local.to(device, copy=True)
    return DTensor.from_local(local, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape,
                              stride=tensor.stride())


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module of `root` that holds dotted `name` (made on the way where missing), and the name's last part."""
    *path, leaf = name.split(".")
    owner = root
    for part in path:
        if not isinstance(child := getattr(owner, part, None), nn.Module):
            owner.add_module(part, child := nn.Module())
        owner = child
    return owner, leaf


def _check_pairs(model: nn.Module, copy: nn.Module) -> None:
    """Lightning's callback pairs the copy's tensors with the model's by order (its swap for validation, its copy
    into the model at the end): a RuntimeError where the names, in order, differ."""
    own = [_saved_name(name) for name, _ in model.named_parameters()] + [
        _saved_name(name) for name, _ in model.named_buffers()]
    copied = [name for name, _ in copy.named_parameters()] + [name for name, _ in copy.named_buffers()]
    if own != copied:
        differ = next(i for i, (a, b) in enumerate(zip(own + [""], copied + [""])) if a != b)
        raise RuntimeError(f"the weight average's copy of the model pairs {copied[differ:differ + 1]} with the"
                           f" model's {own[differ:differ + 1]}: its tensors would be averaged with others'")
