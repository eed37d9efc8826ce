"""The baseline: the same model, data, batch and engine as `train.py`, driven by hand without Lightning.

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 benchmarks/raw_loop.py --strategy ddp --steps 40 --out raw.json

One loop per engine: torch DDP, torch FSDP2 (`fully_shard` per block, then the root, as our strategy does), and
`deepspeed.initialize` with the very config our DeepSpeed strategy resolved (`--deepspeed-config`). Each iteration
is timed from the start of one to the start of the next, data loading included, as the Lightning side is.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from lightning_dist.data.pydoc_text import PydocTextDataModule
from lightning_dist.models.gpt import GPTLanguageModel, TransformerBlock


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=("ddp", "fsdp", "deepspeed"), required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--deepspeed-config", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(42)
    module = GPTLanguageModel()  # its configure_optimizers is plain torch: the same AdamW and groups
    data = PydocTextDataModule()
    data.setup("fit")
    sampler = DistributedSampler(data.train_set, num_replicas=world, rank=rank, shuffle=True, seed=42)
    loader = DataLoader(data.train_set, batch_size=data.batch_size, sampler=sampler)
    step = _engine(args, module)

    starts = []
    for index, (inputs, targets) in enumerate(loader):
        starts.append(time.perf_counter())
        if index == args.steps:
            break
        step(inputs, targets)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    gathered = [None] * world
    dist.all_gather_object(gathered, {"iteration_s": [b - a for a, b in zip(starts, starts[1:])], "peak_rss": peak})
    if rank == 0:
        args.out.write_text(json.dumps(gathered))
    dist.barrier()  # leave together: a rank tearing gloo down while the other still writes can hang at exit
    dist.destroy_process_group()


def _engine(args, module: GPTLanguageModel):
    def loss_of(model, inputs, targets):
        logits = model(inputs)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    if args.strategy == "deepspeed":
        import deepspeed

        config = json.loads(args.deepspeed_config.read_text())
        engine, _, _, _ = deepspeed.initialize(model=module.model, optimizer=module.configure_optimizers(), config=config)

        def step(inputs, targets):
            loss = loss_of(engine, inputs, targets)
            engine.backward(loss)
            engine.step()
        return step

    if args.strategy == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(module.model, gradient_as_bucket_view=True)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in module.model.modules():
            if isinstance(block, TransformerBlock):
                fully_shard(block, mesh=mesh)
        model = fully_shard(module.model, mesh=mesh, reshard_after_forward=False)
    optimizer = module.configure_optimizers()

    def step(inputs, targets):
        optimizer.zero_grad(set_to_none=True)
        loss_of(model, inputs, targets).backward()
        optimizer.step()
    return step


if __name__ == "__main__":
    main()
