"""What a rank really holds for its model state: the bytes of every distinct tensor storage that the module and
its optimizers reach (parameters or their local shards, gradients, master weights, moments, flat buffers).

This is a measurement, not a formula: DeepSpeed's flat groups, FSDP2's DTensor shards and DDP's bucket views are
counted once each, by storage, wherever they are reachable from.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn

from lightning_dist._compat.lightning import unwrapped_optimizer
from lightning_dist.parallel.placement import local_part

# How deep to look into an optimizer's attributes: DeepSpeed keeps its groups as lists of lists of tensors.
_SEARCH_DEPTH = 4


def model_state_bytes(module: nn.Module, optimizers: list[Any]) -> dict[str, int]:
    """{device type: bytes} of the distinct storages behind the module's parameters and gradients and the
    optimizers' state, on this rank."""
    storages: dict[tuple[str, int], int] = {}
    for tensor in _model_tensors(module):
        _add(storages, tensor)
    for optimizer in optimizers:
        optimizer = unwrapped_optimizer(optimizer)
        library = type(optimizer).__module__.partition(".")[0]  # an engine's optimizer is built of its own objects
        for tensor in _reachable_tensors(optimizer, _SEARCH_DEPTH, set(), library):
            _add(storages, tensor)
    by_device: dict[str, int] = {}
    for (device, _), nbytes in storages.items():
        by_device[device] = by_device.get(device, 0) + nbytes
    return by_device


def _add(storages: dict[tuple[str, int], int], tensor: torch.Tensor) -> None:
    if tensor.device.type == "meta" or not tensor.numel():
        return
    storage = tensor.untyped_storage()
    try:
        storages[(tensor.device.type, storage.data_ptr())] = storage.nbytes()
    except RuntimeError:  # FSDP2 frees an unsharded parameter's storage between uses: it holds nothing now
        pass


def _model_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    for param in module.parameters():
        yield local_part(param)
        yield param.data  # ZeRO-3 keeps small ("persistent") parameters whole beside their partition; else empty
        if param.grad is not None:
            yield local_part(param.grad)


def _reachable_tensors(obj: Any, depth: int, seen: set[int], library: str) -> Iterator[torch.Tensor]:
    if id(obj) in seen or isinstance(obj, (nn.Module, str, bytes, int, float, bool, type(None))):
        return  # modules: their parameters are counted above, and the engine's module holds the whole model
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield local_part(obj)
        return
    if depth == 0:
        return
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        children = list(obj)
    elif isinstance(obj, torch.optim.Optimizer) or (
        type(obj).__module__.partition(".")[0] == library and hasattr(obj, "__dict__")
    ):
        children = list(vars(obj).values())
    else:
        return
    for child in children:
        yield from _reachable_tensors(child, depth - 1, seen, library)
