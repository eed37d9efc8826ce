"""Model FLOPs utilisation (MFU): the FLOPs a training step of the model needs per token, against what the devices
can do at most.

Model FLOPs per token are PaLM's count (Chowdhery et al. 2022, appendix B): 6N for the matrix products with the N
weights that multiply activations (2N forward, 4N backward), plus 12·L·d·T for attention's scores and weighted sums
over a context of T tokens, in L layers of width d. They are the model's FLOPs, not the hardware's: recomputation
under activation checkpointing adds none, so MFU compares strategies fairly.

A device's peak is NVIDIA's dense (no sparsity) figure for the precision's tensor-core rate on the GPUs of the
table, a rate measured with a matrix product on a CPU, or the figure the user sets.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
from torch import nn

from lightning_dist.memory.hidden_size import hidden_size_of
from lightning_dist.parallel.classes import block_modules
from lightning_dist.parallel.experts import routed_shares

# Device name fragment -> dense FLOP/s per device: (bf16/fp16 tensor cores, tf32 tensor cores, fp32 without them).
# NVIDIA's datasheets; the first fragment the device's name contains wins (so H100 NVL and PCIe before H100 SXM).
GPU_PEAK_FLOPS = {
    "B200": (2250e12, 1100e12, 80e12),   # HGX B200, 1000 W
    "H200": (989e12, 494e12, 67e12),
    "H100 NVL": (835e12, 418e12, 60e12),
    "H100 PCIe": (756e12, 378e12, 51e12),
    "H100": (989e12, 494e12, 67e12),     # SXM
    "A100": (312e12, 156e12, 19.5e12),
}


MEASURED = "measured"  # how a peak this run measured itself says where it came from


@dataclass(frozen=True)
class Utilisation:
    """What turns a run's token rate into MFU: model FLOPs per token, and the peak of each device."""

    flops_per_token: float
    peak_flops_per_device: float
    peak_source: str  # where the peak came from: the GPU table, a measurement, or the user

    def mfu(self, tokens_per_s: float, devices: int) -> float:
        return self.flops_per_token * tokens_per_s / (devices * self.peak_flops_per_device)

    def raised_to(self, tokens_per_s: float, devices: int) -> Utilisation:
        """A peak this run measured that a step then exceeded, raised to the step's rate: the measurement ran while
        other work held the cores (on a loaded CPU it read 40% of what a later step reached, and MFU read 250%).
        MFU is then 1 at that step, never above; the user's figure and NVIDIA's stay as they are."""
        reached = self.flops_per_token * tokens_per_s / devices
        if not self.peak_source.startswith(MEASURED) or reached <= self.peak_flops_per_device:
            return self
        return replace(self, peak_flops_per_device=reached, peak_source=f"{self.peak_source.split(';')[0]}; raised to"
                       " the rate a step reached (the measurement ran while other work held the cores)")


def matmul_parameters(model: nn.Module) -> int:
    """Elements of the weights that multiply activations: every matrix-shaped parameter, counted once, except an
    embedding table only looked up (a table tied to an output layer multiplies, and counts). Vectors (biases, norm
    scales) do no matrix product. Sharded parameters count whole: DTensors report their global shape, and ZeRO-3
    keeps each parameter's full size in `ds_numel`. Of a mixture of experts, a token's share: top k / experts
    (`routed_shares`), so that MFU counts the FLOPs a token costs, not those of every expert."""
    owners: dict[int, tuple[nn.Parameter, set[bool]]] = {}  # parameter -> (it, whether each owner is an embedding)
    for module in model.modules():
        for parameter in module.parameters(recurse=False):
            if len(getattr(parameter, "ds_shape", parameter.shape)) >= 2:
                owners.setdefault(id(parameter), (parameter, set()))[1].add(isinstance(module, nn.Embedding))
    shares = routed_shares(model)
    return round(sum((getattr(p, "ds_numel", None) or p.numel()) * shares.get(key, 1.0)
                     for key, (p, embedding) in owners.items() if False in embedding))


@dataclass(frozen=True)
class ModelFlops:
    """The counts model FLOPs per token are made of."""

    matmul_parameters: int
    layers: int  # the model's blocks
    width: int | None  # the hidden size, when the hyper-parameters (or a Hugging Face config) name it

    @classmethod
    def of(cls, model: nn.Module) -> "ModelFlops":
        return cls(matmul_parameters(model), len(block_modules(model)), attention_width(model))

    def per_token(self, sequence_length: int) -> float:
        """6N + 12·L·d·T; without a hidden size or blocks, 6N alone (the common approximation)."""
        attention = 12 * self.layers * self.width * sequence_length if self.width and self.layers else 0
        return 6 * self.matmul_parameters + attention


def model_flops_per_token(model: nn.Module, sequence_length: int) -> float:
    return ModelFlops.of(model).per_token(sequence_length)


def attention_width(model: nn.Module) -> int | None:
    """The hidden size the module's hyper-parameters name, else the first Hugging Face config inside it."""
    return hidden_size_of(model) or next(
        (size for module in model.modules() if hasattr(module, "config") and (size := hidden_size_of(module))), None)


def gpu_peak_flops(device_name: str, precision: str) -> float | None:
    """The table's dense peak for this GPU and precision; None for a GPU it does not list."""
    for fragment, (half, tf32, fp32) in GPU_PEAK_FLOPS.items():
        if fragment in device_name:
            if "16" in precision:  # bf16-mixed, bf16-true, 16-mixed, 16-true: tensor cores
                return half
            return tf32 if torch.get_float32_matmul_precision() != "highest" else fp32
    return None


def measured_peak_flops(dtype: torch.dtype = torch.float32, size: int = 1024, seconds: float = 0.1,
                        device: torch.device = torch.device("cpu")) -> float:
    """The best rate of `size` x `size` matrix products in `dtype` on this process's threads, over `seconds`: what
    a CPU reaches on the work that dominates a transformer's step. Its own generator: the run's random stream is
    left as it was."""
    generator = torch.Generator(device).manual_seed(0)
    a, b = (torch.randn(size, size, dtype=dtype, device=device, generator=generator) for _ in range(2))
    torch.mm(a, b)  # the first call picks and warms the kernel
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == float("inf"):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def device_peak_flops(device: torch.device, precision: str,
                      peak_tflops: float | None = None) -> tuple[float, str] | None:
    """(peak FLOP/s of one device, where it came from): the user's figure, the GPU table, or on a CPU a measured
    matrix-product rate in the precision's compute dtype. None for a GPU the table does not list."""
    if peak_tflops is not None:
        return peak_tflops * 1e12, "set by the user (peak_tflops)"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name, precision)
        return (peak, f"{name}, NVIDIA's dense figure for {precision}") if peak is not None else None
    dtype = torch.bfloat16 if "bf16" in precision else torch.float32
    measured = f"{MEASURED}: {str(dtype).removeprefix('torch.')} matrix products on this rank's threads"
    return measured_peak_flops(dtype, device=device), measured
