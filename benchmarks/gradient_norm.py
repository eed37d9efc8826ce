"""The host time of one gradient norm, as the training monitor takes it every step: torch's computation over DTensor
gradients (DTensor dispatches each per-tensor norm) against ours (lightning_dist/parallel/grad_norm.py: the local
shards' norms, then one all-reduce), and torch's over the same tensors as plain ones (ddp's gradients); then what
gathering the gradients costs, from the module or from the optimizer.

    python -m benchmarks.gradient_norm [--tensors 388] [--side 8] [--repeats 300]

One gloo rank, a 1-D mesh (FSDP2's layout), tiny tensors: what is left is the host's own time, which a GPU step waits
for when its kernels are short. 388 is the parameter count of gpu_compare's 24-layer model.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from lightning_dist.parallel.grad_norm import total_norm


def per_call_ms(function: Callable[[], torch.Tensor], repeats: int) -> float:
    for _ in range(20):
        function()
    started = time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.perf_counter() - started) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=388)
    parser.add_argument("--side", type=int, default=8, help="each gradient is side x side")
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(probe.getsockname()[1]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    plain = [torch.randn(args.side, args.side) for _ in range(args.tensors)]
    sharded = [DTensor.from_local(tensor, mesh, [Shard(0)]) for tensor in plain]
    rows = {
        "torch, DTensor gradients": lambda: torch.nn.utils.get_total_norm(sharded).full_tensor(),
        "ours, DTensor gradients": lambda: total_norm(sharded),
        "torch, plain gradients": lambda: torch.nn.utils.get_total_norm(plain),
    }
    assert torch.allclose(rows["torch, DTensor gradients"](), rows["ours, DTensor gradients"]())
    times = {name: per_call_ms(function, args.repeats) for name, function in rows.items()}
    print(f"{args.tensors} gradients of {args.side}x{args.side}, {args.repeats} norms each, one gloo rank")
    print("| computation | ms a norm | against ours |\n|---|---:|---:|")
    for name, ms in times.items():
        print(f"| {name} | {ms:.2f} | {ms / times['ours, DTensor gradients']:.2f} |")
    dist.destroy_process_group()
    gathering_the_gradients(args.repeats)


def gathering_the_gradients(repeats: int) -> None:
    """Before the norm, the gradients: from the module's parameters (a walk that names every module) or from the
    optimizer's groups (a list), on gpu_compare's 24-block GPT."""
    from lightning_dist.models.gpt import GPTLanguageModel

    model = GPTLanguageModel(vocab_size=256, block_size=32, n_layer=24, n_head=2, d_model=32)
    optimizer = torch.optim.AdamW(model.parameters())
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    rows = {
        "`module.parameters()` (before 2026-12-05)": lambda: [p.grad for p in model.parameters() if p.grad is not None],
        "the optimizer's param groups (ours)": lambda: [p.grad for group in optimizer.param_groups
                                                        for p in group["params"] if p.grad is not None],
    }
    times = {name: per_call_ms(function, repeats) for name, function in rows.items()}
    print(f"\nthe gradients of a 24-block GPT ({len(list(model.parameters()))} parameters), {repeats} times each")
    print("| gathered from | ms a step |\n|---|---:|")
    for name, ms in times.items():
        print(f"| {name} | {ms:.2f} |")


if __name__ == "__main__":
    main()
