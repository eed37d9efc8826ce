"""The module's state that is not a parameter, on the rank's device, whatever engine placed the parameters.

Lightning moves a module to its device with `.to()`, which moves parameters, buffers and torchmetrics' states alike.
A sharding engine places the parameters itself, and then nothing moves the rest: ZeRO-3 leaves a model built without
weights where it was built (DeepSpeed's engine moves only a module it did not partition), and FSDP's CPU offload
keeps the module on the host for its shards. On a GPU the first metric update then fails (`val_loss.update`:
"Encountered different devices in metric calculation"), and a buffer on the host fails its module's forward. On
CPU every device is the host, so only a run with CUDA faked shows it (tests/test_loop_on_cuda.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torchmetrics import Metric


def move_module_state(module: nn.Module, device: torch.device) -> list[str]:
    """Every buffer (persistent or not) and every torchmetrics metric's state of `module` onto `device`; parameters
    stay where the engine put them. Returns the names of what was moved."""
    moved = []
    for name, submodule in module.named_modules():
        for buffer_name, buffer in list(submodule.named_buffers(recurse=False)):
            if not same_device(buffer.device, device):
                setattr(submodule, buffer_name, buffer.to(device))
                moved.append(f"{name}.{buffer_name}" if name else buffer_name)
        if isinstance(submodule, Metric) and not same_device(submodule.device, device):
            submodule.to(device)  # its states and their defaults; a metric holds no parameters of the model
            moved.append(name)
    return moved


def misplaced_module_state(module: nn.Module, device: torch.device) -> list[str]:
    """Each buffer and metric state of `module` that is not on `device`, as `name (on DEVICE)`."""
    found = []
    for name, submodule in module.named_modules():
        prefix = f"{name}." if name else ""
        for buffer_name, buffer in submodule.named_buffers(recurse=False):
            if not same_device(buffer.device, device):
                found.append(f"{prefix}{buffer_name} (on {buffer.device})")
        if isinstance(submodule, Metric):
            for state in submodule.metric_state:
                values = getattr(submodule, state)
                for value in values if isinstance(values, list) else [values]:
                    if isinstance(value, torch.Tensor) and not same_device(value.device, device):
                        found.append(f"{prefix}{state} (on {value.device})")
                        break
    return found


def same_device(found: torch.device, device: torch.device) -> bool:
    """Whether `found` is `device`: its index too, but the host's (Lightning's `cpu:1` is the host)."""
    return found.type == device.type and (device.type == "cpu" or found.index == device.index)
