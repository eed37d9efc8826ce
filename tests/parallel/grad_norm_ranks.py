"""Four gloo ranks compute the norm of gradients laid out as FSDP2, HSDP and FSDP + tensor parallelism lay them out
(lightning_dist/parallel/grad_norm.py, which reduces each mesh's local shards itself) and compare it with the norm of
the whole tensors: `python -m tests.parallel.grad_norm_ranks OUT.json` writes rank 0's {case: {norm type: [ours,
whole]}} and the norm each rank found, to check that every rank has the same.

The shapes split unevenly over 4 ranks, one leaves a rank an empty shard (where torch's own infinity norm of DTensors
raises on that rank alone, and the others then wait for it), and one mesh holds gradients sharded two ways at once.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_dist.lifecycle.process_exit import close_process_group
from lightning_dist.parallel import grad_norm
from lightning_dist.parallel.grad_norm import total_norm

RANKS = 4
NORM_TYPES = {"2": 2.0, "1": 1.0, "inf": math.inf, "3": 3.0}


def whole_gradients() -> list[torch.Tensor]:
    torch.manual_seed(0)
    # 7 rows over 4 ranks: 2, 2, 2, 1; 3 elements: the last rank's shard is empty; a scalar is never split.
    return [torch.randn(7, 6), torch.randn(3), torch.randn(16, 4), torch.randn(()), torch.randn(2, 9), torch.randn(8, 5)]


def laid_out(tensor: torch.Tensor, mesh, placements: list[Placement]):
    """`tensor` distributed with `placements`, a dimension it lacks replicated instead (a bias under row sharding)."""
    fitting = [p if not isinstance(p, Shard) or p.dim < tensor.dim() else Replicate() for p in placements]
    return distribute_tensor(tensor, mesh, fitting, src_data_rank=None)  # every rank has the whole: no scatter


def cases(flat, grid) -> dict[str, list]:
    whole = whole_gradients()
    half = len(whole) // 2
    return {
        "fsdp": [laid_out(t, flat, [Shard(0)]) for t in whole],
        "replicated": [laid_out(t, flat, [Replicate()]) for t in whole],
        "hsdp": [laid_out(t, grid, [Replicate(), Shard(0)]) for t in whole],
        "fsdp_tp": [laid_out(t, grid, [Shard(0), Shard(1)]) for t in whole],
        "fsdp_tp_row_bias": [laid_out(t, grid, [Shard(0), Replicate()]) for t in whole],
        # FSDP2 over a tensor-parallel split of dim 0 shards that dim again, strided: `_StridedShard`, which is not a
        # Shard (its is_shard() is False; a first version of the norm took it for replicated).
        "fsdp_tp_strided": [laid_out(t, grid, [_StridedShard(0, split_factor=2), Shard(0)]) for t in whole[:3]]
        + [laid_out(t, grid, [Shard(0), Replicate()]) for t in whole[3:]],
        # Two ways on one mesh, and two meshes in one call (tensor parallelism's layers and the rest).
        "mixed": [laid_out(t, grid, [Shard(0), Shard(1)]) for t in whole[:half]]
        + [laid_out(t, grid, [Replicate(), Shard(0)]) for t in whole[half:]],
        "two_meshes": [laid_out(t, grid, [Shard(0), Shard(1)]) for t in whole[:half]]
        + [laid_out(t, flat, [Shard(0)]) for t in whole[half:]],
    }


def run(rank: int, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    try:
        flat, grid = init_device_mesh("cpu", (RANKS,)), init_device_mesh("cpu", (2, RANKS // 2))
        whole = whole_gradients()
        found: dict[str, dict[str, list[float]]] = {}
        for case, grads in cases(flat, grid).items():
            found[case] = {name: [total_norm(grads, p).item(), torch.nn.utils.get_total_norm(whole, p).item()]
                           for name, p in NORM_TYPES.items()}
        # Unreduced gradients (Partial: each rank holds a summand) go through DTensor's own computation.
        summands = [DTensor.from_local(t if rank == 0 else torch.zeros_like(t), flat, [Partial()]) for t in whole]
        found["partial"] = {"2": [total_norm(summands).item(), torch.nn.utils.get_total_norm(whole).item()]}
        every_rank: list = [None] * RANKS
        dist.all_gather_object(every_rank, found)
        same_on_every_rank = all(f == found for f in every_rank)
        # A rule that is wrong for a placement (here: shards taken for copies) is stopped by the check of the rule,
        # made once per placement: the elements it would count against the tensors'.
        sharded = [laid_out(t, flat, [Shard(0)]) for t in whole]
        try:
            grad_norm._check_rule((Replicate(),), sharded, flat)
        except RuntimeError as refusal:
            found["refusal"] = str(refusal)
        if rank == 0:
            Path(out).write_text(json.dumps({"rank0": found, "same_on_every_rank": same_on_every_rank}))
    finally:
        close_process_group()


if __name__ == "__main__":
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(run, args=(sys.argv[1], port), nprocs=RANKS)
