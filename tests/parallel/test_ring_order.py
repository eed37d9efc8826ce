"""`ring` shards every sequence as torch's ring attention expects it: torch's own causal load balancing (read from
torch by sharding a positions buffer, so the batch and torch's expectation cannot differ), rank r holding chunks r
and 2 x cp - 1 - r of 2 x cp; the model's positions are the held ones."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO

SHARDS = """
import json, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from lightning_dist.parallel.context_parallel import RingContextParallel
held = {}
for rank in (0, 1):
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    ring = RingContextParallel(init_device_mesh("cpu", (2,)), rank, 2)
    tokens = torch.arange(16).reshape(2, 8)
    inputs, targets = ring.shard((tokens, tokens + 100))
    held[rank] = [inputs.tolist(), targets.tolist(), ring.held_positions(torch.arange(4)).tolist(),
                  ring.held_positions(torch.arange(4).expand(2, 4)).tolist()]
print(json.dumps(held))
"""


def test_each_rank_holds_torchs_head_and_tail_chunks_of_every_sequence_and_their_positions():
    run = subprocess.run([sys.executable, "-c", SHARDS], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    held = json.loads(run.stdout.strip().splitlines()[-1])
    assert held["0"] == [[[0, 1, 6, 7], [8, 9, 14, 15]], [[100, 101, 106, 107], [108, 109, 114, 115]], [0, 1, 6, 7],
                         [[0, 1, 6, 7]] * 2]
    assert held["1"] == [[[2, 3, 4, 5], [10, 11, 12, 13]], [[102, 103, 104, 105], [110, 111, 112, 113]], [2, 3, 4, 5],
                         [[2, 3, 4, 5]] * 2]
