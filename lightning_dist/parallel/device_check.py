"""The device check of a dry run: every op's tensors on one device, and every collective's on the rank's own.

Under fake tensors, an op given tensors on two devices fails as it would on a GPU (`cuda:5 and cpu`); this check
names the op in that message. A collective is checked against the process group's backends: nccl sends only
tensors on the rank's own device (`cuda:<local rank>`), gloo host tensors where the run keeps state on the host. The
fake process group itself accepts anything, so without this check a host tensor given to `all_gather` would pass.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_dist._compat.fake_tensors import device_mismatch
from lightning_dist._compat.torch import COLLECTIVE_NAMESPACES, TorchDispatchMode, tree_map

# Collectives whose tensor the process group makes itself, on the device its backend uses (a barrier's placeholder:
# the fake backend's is on the host, nccl's on the rank's device), and sends nothing of the caller's.
OWN_PLACEHOLDERS = ("barrier",)


def collective_devices(backend: str, root: torch.device) -> tuple[torch.device, ...]:
    """The devices whose tensors `backend` ("nccl", "gloo", "cpu:gloo,cuda:nccl") sends, for a rank on `root`."""
    types = [part.split(":")[0] if ":" in part else ("cuda" if part == "nccl" else "cpu")
             for part in backend.split(",")]
    return tuple(root if kind == root.type else torch.device(kind) for kind in types)


class DeviceMismatch(RuntimeError):
    """An op or collective given a tensor on a device it cannot use."""


class OneDevicePerRank(TorchDispatchMode):
    """Fails any op given tensors on two devices, and any collective given a tensor on none of `collective_devices`
    (the rank's own device, and the host where the process group has a host backend)."""

    def __init__(self, rank: int, collective_devices: tuple[torch.device, ...]) -> None:
        super().__init__()
        self.rank, self.collective_devices = rank, collective_devices

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace in COLLECTIVE_NAMESPACES and func.overloadpacket.__name__ not in OWN_PLACEHOLDERS:
            self._check_collective(func, (args, kwargs))
        try:
            return func(*args, **kwargs)
        except Exception as error:
            devices = device_mismatch(error)
            if devices is None:
                raise
            raise DeviceMismatch(f"rank {self.rank}: {func} was given tensors on {devices[0]} and {devices[1]}; "
                                 "a GPU run fails here the same way") from error

    def _check_collective(self, func: Any, arguments: Any) -> None:
        found: list[torch.device] = []
        tree_map(lambda value: found.append(value.device) if isinstance(value, torch.Tensor) else None, arguments)
        for device in found:
            if device not in self.collective_devices:
                own = " or ".join(str(d) for d in self.collective_devices)
                raise DeviceMismatch(f"rank {self.rank}: the collective {func} was given a tensor on {device}; this"
                                     f" rank's collectives send tensors on {own}")
