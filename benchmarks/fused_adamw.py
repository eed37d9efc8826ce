"""What the fused AdamW our optimizer configs default to saves: the optimizer step alone, on gpt_medium's parameters.

    python -m benchmarks.fused_adamw [--threads 1] [--steps 20]

torch's three AdamW implementations on the same parameters and gradients, in turn (for-loop, foreach, fused), each
timed over `--steps` steps after 3 warm-up steps, with the intra-op threads a rank has on this machine (1 of 2
cores per rank). Prints the median step of each and the fused speed-up over foreach, torch's default without
`fused=True`. torch documents the fused kernels as the fastest where they exist (CUDA and, in torch 2.13, CPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lightning_dist.models.gpt import GPTLanguageModel

IMPLEMENTATIONS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def median_step(parameters: list[torch.Tensor], steps: int, **implementation: bool) -> float:
    optimizer = torch.optim.AdamW(parameters, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01, **implementation)
    times = []
    for step in range(3 + steps):
        start = time.perf_counter()
        optimizer.step()
        if step >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPTLanguageModel(n_layer=8, d_model=768, n_head=12)  # gpt_medium
    parameters = [p for p in model.parameters() if p.requires_grad]
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter) * 1e-3
    count = sum(p.numel() for p in parameters)
    print(f"AdamW step on {count / 1e6:.1f}M parameters, {args.threads} thread(s), median of {args.steps} steps:\n")
    print("| implementation | median step (ms) |\n|---|---:|")
    medians = {}
    for name, implementation in IMPLEMENTATIONS.items():
        medians[name] = median_step(parameters, args.steps, **implementation)
        print(f"| {name} | {medians[name] * 1e3:.1f} |", flush=True)
    print(f"\nfused is {medians['foreach'] / medians['fused']:.2f}x foreach and "
          f"{medians['for-loop'] / medians['fused']:.2f}x the for-loop")


if __name__ == "__main__":
    main()
