"""Instruments that make CUDA device mistakes visible on a CPU-only machine.

On CPU every tensor is a host tensor, so a collective handed a tensor made without `device=` works under gloo and
fails only under NCCL, on the first GPU run. Two torch modes close that gap:

- `CarelessTensorsOnMeta` (a TorchFunctionMode): a factory call (`torch.tensor`, `zeros`, `full`, ...) made *from the
  package's own code* without a `device=` creates a meta tensor instead of a host one. The strategy's root device
  stays the CPU, so "where a careless tensor lands" and "the root device" now differ, exactly as on a GPU rank.
  Only calls from the watched packages are redirected: Lightning, torch and the data pipeline (whose tensors are
  host tensors by design; Lightning moves batches) run as usual. It also counts host reads (`.item()`,
  `.tolist()`, `bool(t)`, ...) made from those packages, by training step: on a GPU each one waits for the device.
- `CollectiveDeviceAudit` (a TorchDispatchMode): every c10d collective, whoever calls it (our code, Lightning,
  torch's FSDP and DTensor, DeepSpeed), must get tensors on the root device only; otherwise it raises, naming the
  collective and the device, before the backend sees them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

FACTORIES = frozenset({
    torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.zeros, torch.ones, torch.full, torch.empty,
    torch.arange, torch.linspace, torch.eye, torch.rand, torch.randn, torch.randint,
})
HOST_READS = frozenset({"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy"})
COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})


class CarelessTensorsOnMeta(TorchFunctionMode):
    def __init__(
        self,
        packages: tuple[str, ...] = ("lightning_dist",),
        exclude: tuple[str, ...] = ("lightning_dist.data",),
        step: Callable[[], int | None] = lambda: None,
    ) -> None:
        super().__init__()
        self.packages, self.exclude, self.step = packages, exclude, step
        self.redirected: list[str] = []
        self.host_reads: list[tuple[int | None, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        caller = self._watched_caller()
        if caller is not None:
            if func in FACTORIES and kwargs.get("device") is None:
                kwargs["device"] = "meta"
                self.redirected.append(f"{func.__name__} at {caller}")
            elif getattr(func, "__name__", None) in HOST_READS:
                self.host_reads.append((self.step(), f"{func.__name__} at {caller}"))
        return func(*args, **kwargs)

    def _watched_caller(self) -> str | None:
        frame = sys._getframe(2)  # 0: here, 1: __torch_function__, 2: whoever called the torch function
        module = frame.f_globals.get("__name__", "")
        if module.startswith(self.packages) and not module.startswith(self.exclude):
            return f"{module}:{frame.f_lineno}"
        return None


class CollectiveDeviceAudit(TorchDispatchMode):
    def __init__(self, root_device: torch.device) -> None:
        super().__init__()
        self.root_device = root_device
        self.seen: list[str] = []
        self.violations: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in COLLECTIVE_NAMESPACES:
            self.seen.append(func.name())
            wrong = sorted({str(t.device) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and not self._on_root(t)})
            if wrong:
                self.violations.append(f"{func.name()} got tensors on {', '.join(wrong)}")
                raise AssertionError(f"{func.name()} got tensors on {', '.join(wrong)}; the strategy's root device is {self.root_device}")
        return func(*args, **kwargs)

    def _on_root(self, tensor: torch.Tensor) -> bool:
        device = tensor.device
        # torch ignores a CPU index (DeepSpeed gives each CPU rank one); a CUDA index must match.
        return device.type == self.root_device.type and (device.type == "cpu" or device.index == self.root_device.index)
