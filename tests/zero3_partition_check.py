"""Each rank's ZeRO-3 partitions written from the rows of each parameter it reads alone (strategies/deepspeed/
engine.py's `zero3_partitioner`, DeepSpeed's broadcast from rank 0 left out), then gathered back by DeepSpeed: the
values eager construction gives, for shapes that split evenly and unevenly, with fewer elements than ranks, and a
scalar; and a layout other than DeepSpeed's is refused in one line, not partitioned wrong.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 3 -m tests.zero3_partition_check OUT.json

Rank 0 writes {"gathered": {name: max |gathered - eager|}, "rows": [{name: [start, stop] of the rows it read, or
None: all} for each rank], "refusal": the error's message, "hierarchical": the same gathered and rows under ZeRO++'s
hierarchical partitioning, which reads each parameter whole}.
"""

from __future__ import annotations

import json
import sys

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

import lightning_dist._compat.deepspeed as compat
import lightning_dist.strategies.deepspeed.engine as engine
from lightning_dist._compat.deepspeed import skip_shared_memory_comm_op
from lightning_dist.parallel.sharded_init import initialize_parameters, parameters_on_meta

SEED = 11
CONFIG = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}


class Shapes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.matrix = nn.Parameter(torch.empty(7, 5))  # 35 elements: 12, 12, 11 on 3 ranks
        self.cube = nn.Parameter(torch.empty(3, 4, 5))
        self.vector = nn.Parameter(torch.empty(5))
        self.one = nn.Parameter(torch.empty(1))  # fewer elements than ranks
        self.scalar = nn.Parameter(torch.empty(()))

    def reset_parameters(self) -> None:
        for param in self.parameters():
            nn.init.normal_(param)


def partitioned(config: dict = CONFIG) -> tuple[nn.Module, dict[str, list[int]]]:
    with parameters_on_meta():
        model = Shapes()
    keep, rows = engine.zero3_partitioner(config)
    names = {id(p): name for name, p in model.named_parameters()}
    read = {}

    def region(param: nn.Parameter):
        found = rows(param)
        read[names[id(param)]] = [found[0].start, found[0].stop] if found is not None else None
        return found

    initialize_parameters(model, keep, SEED, params=list(model.parameters()), region=region)
    return model, read


def main(out: str) -> None:
    skip_shared_memory_comm_op()  # a native op built for minutes, which gloo does not use
    deepspeed.init_distributed(dist_backend="gloo")
    eager = Shapes()
    initialize_parameters(eager, seed=SEED)
    model, read = partitioned()
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        gathered = {name: (param.detach() - eager.get_parameter(name).detach()).abs().max().item()
                    for name, param in model.named_parameters()}
    # ZeRO++'s hierarchical partitioning keeps a second partition per node, made from the whole parameter.
    hierarchical, hierarchical_read = partitioned({**CONFIG, "zero_optimization": {"stage": 3,
                                                                                  "zero_hpz_partition_size": 3}})
    secondary = {}  # each node's second partition (here every rank's: hpZ over the 3 ranks) against eager's values
    for name, param in hierarchical.named_parameters():
        flat, size = eager.get_parameter(name).detach().reshape(-1), param.ds_secondary_tensor.numel()
        start = min(size * dist.get_rank(), flat.numel())
        held = flat[start:start + size]
        secondary[name] = (param.ds_secondary_tensor[:len(held)] - held).abs().max().item() if len(held) else 0.0
    every_secondary: list = [None] * dist.get_world_size()
    dist.all_gather_object(every_secondary, secondary)
    with deepspeed.zero.GatheredParameters(list(hierarchical.parameters())):
        gathered_hierarchical = {name: (param.detach() - eager.get_parameter(name).detach()).abs().max().item()
                                 for name, param in hierarchical.named_parameters()}
    # What lightning_dist would do if DeepSpeed laid its partitions out otherwise than it expects.
    real = engine.partition_elements
    engine.partition_elements = compat.partition_elements = lambda init, param: tuple(  # type: ignore[assignment]
        min(e + 1, param.numel()) for e in real(init, param))
    try:
        partitioned()
        refusal = None
    except RuntimeError as error:
        refusal = str(error)
    every_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, read)
    if dist.get_rank() == 0:
        with open(out, "w") as file:
            json.dump({"gathered": gathered, "rows": every_rank, "refusal": refusal,
                       "hierarchical": {"gathered": gathered_hierarchical, "rows": hierarchical_read,
                                        "secondary": every_secondary}}, file)
    dist.barrier()
    dist.destroy_process_group()  # with hpZ's groups, which a rank left to exit with them aborts on


if __name__ == "__main__":
    main(sys.argv[1])
