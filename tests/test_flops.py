"""Model FLOPs utilisation's two terms: the model's FLOPs per token, checked against torch's own count of a training
step, and a device's peak (NVIDIA's table; on a CPU, a measured matrix-product rate)."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lightning_dist.models.gpt import GPTLanguageModel
from lightning_dist.reports.flops import (
    Utilisation,
    device_peak_flops,
    gpu_peak_flops,
    matmul_parameters,
    measured_peak_flops,
    model_flops_per_token,
)


def counted_by_torch(model: nn.Module, tokens: torch.Tensor) -> float:
    """FLOPs per token of one forward and backward, as torch's FlopCounterMode counts the matrix products. The math
    attention kernel makes attention's products visible to it (the fused CPU kernel is not counted)."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens).float().sum().backward()
    return counter.get_total_flops() / tokens.numel()


@pytest.mark.parametrize("sequence_length", [128, 32])
def test_the_default_models_flops_per_token_are_what_torch_counts_in_a_training_step(sequence_length):
    module = GPTLanguageModel()  # the default model: d_model 128, 4 blocks, vocabulary 256 (tied output layer)
    tokens = torch.randint(0, 256, (2, sequence_length))
    counted = counted_by_torch(module.model, tokens)
    assert model_flops_per_token(module, sequence_length) == counted
    # 6N for the weights that multiply (4 x 12 d^2 in the blocks, the tied 256 x d output layer; not the position
    # table, biases or norms) and 12 L d T for attention.
    assert counted == 6 * (4 * 12 * 128**2 + 256 * 128) + 12 * 4 * 128 * sequence_length


def test_a_tied_table_counts_once_a_looked_up_one_not_at_all_and_sharded_ones_whole():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.positions = nn.Embedding(10, 4), nn.Embedding(6, 4)
            self.hidden, self.out = nn.Linear(4, 4), nn.Linear(4, 10, bias=False)
            self.out.weight = self.tokens.weight

    assert matmul_parameters(Tiny()) == 10 * 4 + 4 * 4
    partitioned = Tiny()
    partitioned.hidden.weight = nn.Parameter(torch.empty(0))  # as ZeRO-3 leaves a partitioned parameter
    partitioned.hidden.weight.ds_shape, partitioned.hidden.weight.ds_numel = (4, 4), 16
    assert matmul_parameters(partitioned) == 10 * 4 + 4 * 4


def test_the_gpu_table_gives_dense_peaks_by_name_and_precision():
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", "bf16-mixed") == 989e12
    assert gpu_peak_flops("NVIDIA H100 PCIe", "16-mixed") == 756e12
    assert gpu_peak_flops("NVIDIA H100 NVL", "bf16-true") == 835e12
    assert gpu_peak_flops("NVIDIA H200", "bf16-mixed") == 989e12
    assert gpu_peak_flops("NVIDIA B200", "bf16-mixed") == 2250e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", "32-true") == 19.5e12  # torch's fp32 matmuls: no tensor cores
    assert gpu_peak_flops("NVIDIA GeForce RTX 4090", "bf16-mixed") is None
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # fp32 matmuls on TF32 tensor cores
        assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", "32-true") == 156e12
    finally:
        torch.set_float32_matmul_precision(before)


def test_the_cpu_peak_is_the_rate_of_a_matrix_product_timed_here():
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    torch.mm(a, b)
    timed = []
    for _ in range(5):
        start = time.perf_counter()
        torch.mm(a, b)
        timed.append(time.perf_counter() - start)
    rate = 2 * 1024**3 / min(timed)
    peak, source = device_peak_flops(torch.device("cpu"), "32-true")
    assert source == "measured: float32 matrix products on this rank's threads"
    assert rate / 3 < peak < rate * 3  # the same work timed twice; a loaded machine moves both
    assert device_peak_flops(torch.device("cpu"), "32-true", peak_tflops=2.5) == (2.5e12, "set by the user (peak_tflops)")
    assert measured_peak_flops(torch.bfloat16, size=256, seconds=0.05) > 0


def test_mfu_is_the_models_flops_at_the_token_rate_over_every_devices_peak():
    utilisation = Utilisation(flops_per_token=6e9, peak_flops_per_device=1e12, peak_source="set by the user")
    assert utilisation.mfu(tokens_per_s=100, devices=2) == pytest.approx(0.3)


def test_a_measured_peak_a_step_exceeds_is_raised_to_that_step_so_mfu_never_reads_above_one():
    """A CPU's peak is measured at the start; measured while other work held the cores, a later step ran faster than
    it and MFU read 250%. The user's figure and NVIDIA's are kept as given."""
    measured = Utilisation(flops_per_token=6e9, peak_flops_per_device=1e11,
                           peak_source="measured: float32 matrix products on this rank's threads")
    assert measured.mfu(tokens_per_s=50, devices=2) == pytest.approx(1.5)
    raised = measured.raised_to(tokens_per_s=50, devices=2)
    assert raised.peak_flops_per_device == pytest.approx(1.5e11) and raised.mfu(50, 2) == pytest.approx(1.0)
    assert raised.peak_source == ("measured: float32 matrix products on this rank's threads; raised to the rate a step"
                                  " reached (the measurement ran while other work held the cores)")
    assert raised.raised_to(tokens_per_s=40, devices=2) is raised  # a slower step: MFU below 1 again
    assert raised.raised_to(tokens_per_s=60, devices=2).peak_source == raised.peak_source  # said once
    assert measured.raised_to(tokens_per_s=10, devices=2) is measured  # below the peak: as measured
    given = Utilisation(flops_per_token=6e9, peak_flops_per_device=1e11, peak_source="set by the user (peak_tflops)")
    assert given.raised_to(tokens_per_s=50, devices=2) is given and given.mfu(50, 2) == pytest.approx(1.5)
