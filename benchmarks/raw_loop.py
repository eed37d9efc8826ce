"""The baseline: the same model, data, batch and engine as `train.py`, driven by hand without Lightning.

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 benchmarks/raw_loop.py --strategy ddp --steps 40 --out raw.json

One loop per engine: torch DDP, torch FSDP2 (`fully_shard` per block, then the root, as our strategy does; with
`--activation-checkpointing` each block in torch's checkpoint wrapper first, with `--cpu-offload` torch's
`CPUOffloadPolicy`; with `--tensor-parallel N` each block first split over N ranks by torch's own
`parallelize_module`, colwise and rowwise as in torchtitan, on a data x tensor mesh), and `deepspeed.initialize`
with the very config our DeepSpeed strategy resolved (`--deepspeed-config`; with its optimizer offloaded,
DeepSpeed's CPU Adam with the same hyper-parameters, as ours swaps in). `--model key=value ...` are the model's
hyper-parameters and `--batch-size` the per-rank batch, as train.py's `model.*` and `data.batch_size`. Each
iteration is timed from the start of one to the start of the next, data loading included, as the Lightning side is.

`--pipeline-parallel P --pipeline-schedule NAME [--stages-per-rank S]` (fsdp only) is torch's own pipelining as its
tutorial writes it: the blocks split evenly into P x S stages (`PipelineStage`, stage s on rank s mod P), the first
holding the embeddings, the last the final norm and an output head that starts as a copy of the token embedding
(GPT-2's tied weight: after backward the two gradients are summed over the first and last stage, as Megatron-LM
does), each stage's blocks and then the stage sharded by `fully_shard` over the data-parallel ranks (pipeline
outermost, as ours), the schedule (`get_schedule_class(NAME)`) given P x S microbatches of each batch.
`--context-parallel C` (fsdp only) is Ulysses written out: each rank embeds its contiguous 1/C of every sequence
(positions shifted to its place), each attention exchanges q, k and v for the whole sequence and 1/C of the heads
by one differentiable all-to-all each, runs SDPA (causal) and exchanges the output back; FSDP shards over all ranks
(data x context), whose gradient average is the whole sequences' mean.

`--compile` compiles each block as an expert would by hand, before the engine wraps the model (torchtitan's order):
`block.compile()`, and under ZeRO-3 the block's forward alone with the block made a ZeRO-3 leaf module (DeepSpeed's
hooks, which the compiler cannot trace, gather the block's parameters around the compiled code; `block.compile()`
there splits each block at every submodule's hook). torch._dynamo's counters after each iteration are written too.

On a GPU (`--device cuda`: nccl, each rank its own GPU; `--precision bf16-mixed`: autocast, as Lightning's, and
under FSDP also its bf16 gathers with fp32 reductions, as our strategy's `MixedPrecisionPolicy`; under DeepSpeed its
config says) iterations are timed by CUDA events, so that the clock never waits for the device, and
the CUDA peak (`max_memory_allocated`) is reported beside the peak resident set.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import resource
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `torchrun benchmarks/raw_loop.py`, from any directory

from benchmarks.timing import PROFILED_STEPS, StepClock, cprofile_path, dynamo_counters, profiler_table  # noqa: E402
from lightning_dist.data.pydoc_text import PydocTextDataModule  # noqa: E402
from lightning_dist.models.gpt import GPTLanguageModel  # noqa: E402
from lightning_dist.optim.configured import DEFAULT_OPTIMIZER  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=("ddp", "fsdp", "deepspeed"), required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--deepspeed-config", type=Path)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--cpu-offload", action="store_true")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="ranks each block is split over (fsdp only)")
    parser.add_argument("--pipeline-parallel", type=int, default=1, help="pipeline ranks (fsdp only)")
    parser.add_argument("--pipeline-schedule", default="1F1B", help="torch's schedule class, by its name")
    parser.add_argument("--stages-per-rank", type=int, default=1)
    parser.add_argument("--context-parallel", type=int, default=1, help="ranks each sequence is split over (fsdp only)")
    parser.add_argument("--model", nargs="*", default=[], help="hyper-parameters, key=value (numbers)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--compile", action="store_true", help="compile each block (regional torch.compile)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--precision", choices=("32-true", "bf16-mixed"), default="32-true")
    parser.add_argument("--block-size", type=int, default=128, help="tokens per sample, as train.py's data.block_size")
    parser.add_argument("--profile", type=Path, help="torch.profiler's operator table of rank 0's PROFILED_STEPS")
    parser.add_argument("--cprofile", type=Path, help="cProfile of every rank's PROFILED_STEPS: <path>_rank<N>.prof")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # Ranks of one tensor- or context-parallel group see the same batch (tensor and context inner, pipeline outer):
    # the sampler counts data-parallel ranks.
    inner = args.tensor_parallel * args.context_parallel
    data_ranks = world // inner // args.pipeline_parallel
    data_rank = rank // inner % data_ranks
    torch.manual_seed(42)
    hyper_parameters = {key: float(value) if "." in value or "e" in value else int(value)
                        for key, value in (item.split("=", 1) for item in args.model)}
    # `lr` is the optimizer's (train.py's model.optimizer.lr): the same fused AdamW our optimizer config builds.
    optimizer = partial(DEFAULT_OPTIMIZER, lr=hyper_parameters.pop("lr", DEFAULT_OPTIMIZER.keywords["lr"]))
    hyper_parameters["block_size"] = args.block_size
    with torch.device(device):
        module = GPTLanguageModel(**hyper_parameters, optimizer=optimizer)  # configure_optimizers: plain torch
    data = PydocTextDataModule(block_size=args.block_size, batch_size=args.batch_size)
    data.setup("fit")
    sampler = DistributedSampler(data.train_set, num_replicas=data_ranks, rank=data_rank, shuffle=True, seed=42)
    loader = DataLoader(data.train_set, batch_size=args.batch_size, sampler=sampler)
    step = _engine(args, module)
    clock = StepClock(device)

    profiler, dynamo, losses = None, [], []  # each step's loss as a tensor: read once, after the clock stops
    for index, (inputs, targets) in enumerate(loader):
        clock.tick()
        if args.profile and rank == 0 and index in (PROFILED_STEPS.start, PROFILED_STEPS.stop):
            if profiler is None:
                profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                profiler.__enter__()
            else:
                profiler.__exit__(None, None, None)
                profiler_table(profiler, args.profile)
        if args.cprofile and index in (PROFILED_STEPS.start, PROFILED_STEPS.stop):
            if index == PROFILED_STEPS.start:
                cprofile = cProfile.Profile()
                cprofile.enable()
            else:
                cprofile.disable()
                cprofile.dump_stats(cprofile_path(args.cprofile, rank))
        if index == args.steps:
            break
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        if args.context_parallel > 1:  # this rank's contiguous shard of every sequence
            inputs, targets = (tensor.chunk(args.context_parallel, dim=1)[rank % args.context_parallel]
                               for tensor in (inputs, targets))
        with torch.autocast(device.type, torch.bfloat16, enabled=args.precision == "bf16-mixed" and args.strategy != "deepspeed"):
            losses.append(step(inputs, targets))
        dynamo.append(dynamo_counters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cuda_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    gathered = [None] * world
    dist.all_gather_object(gathered, {"iteration_s": clock.intervals(), "peak_rss": peak, "cuda_peak": cuda_peak,
                                      "dynamo": dynamo, "losses": [None if x is None else x.item() for x in losses]})
    if rank == 0:
        args.out.write_text(json.dumps(gathered))
    dist.barrier()  # leave together: a rank tearing gloo down while the other still writes can hang at exit
    dist.destroy_process_group()
    # Without the interpreter's teardown, where a gloo thread dropping Python state can still abort the process
    # ("terminate called without an active exception", once in 8 runs): train.py leaves the same way (lifecycle/quick_exit.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _engine(args, module: GPTLanguageModel):
    def loss_of(model, inputs, targets):
        logits = model(inputs)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    if args.strategy == "deepspeed":
        import deepspeed
        from deepspeed.utils import set_z3_leaf_modules

        from lightning_dist._compat.deepspeed import skip_shared_memory_comm_op
        from lightning_dist.strategies.deepspeed.offload import as_deepspeed_cpu_adam

        # On the CPU, DeepSpeed's comm backend compiles a shared-memory op as it starts (a minute and a half of both
        # cores on a first use) that only inference's all-reduce calls: no step of this loop, nor of ours, which skips
        # it the same way. On a GPU it is never built.
        skip_shared_memory_comm_op()

        config = json.loads(args.deepspeed_config.read_text())
        if args.compile and config["zero_optimization"].get("stage") == 3:
            set_z3_leaf_modules(module.model, [type(module.model.blocks[0])])
            for block in module.model.blocks:
                block.forward = torch.compile(block.forward)
        elif args.compile:
            for block in module.model.blocks:
                block.compile()
        optimizer = module.configure_optimizers()
        if (config["zero_optimization"].get("offload_optimizer") or {}).get("device") in ("cpu", "nvme"):
            optimizer = as_deepspeed_cpu_adam(optimizer)  # the swap our strategy makes, the same function
        engine, _, _, _ = deepspeed.initialize(model=module.model, optimizer=optimizer, config=config)

        def step(inputs, targets):
            loss = loss_of(engine, inputs, targets)
            engine.backward(loss)
            engine.step()
            return loss.detach()
        return step

    if args.pipeline_parallel > 1:
        return _pipelined(args, module)
    if args.context_parallel > 1:
        _exchange_attention(module.model, args.context_parallel)

    if args.strategy == "ddp":
        if args.compile:
            for block in module.model.blocks:
                block.compile()
        model = torch.nn.parallel.DistributedDataParallel(module.model, gradient_as_bucket_view=True)
    else:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        tp = args.tensor_parallel
        meshes = init_device_mesh(next(module.parameters()).device.type, (dist.get_world_size() // tp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
        mesh = meshes["data_parallel"]
        offload = CPUOffloadPolicy(pin_memory=False) if args.cpu_offload else OffloadPolicy()
        # bf16-mixed as our FSDP strategy runs it (until 2026-12-04 this loop autocast fp32 parameters only).
        bf16 = args.precision == "bf16-mixed"
        precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
        blocks = module.model.blocks
        for index, block in enumerate(blocks):
            if tp > 1:
                _split(block, meshes["tensor_parallel"])
            if args.activation_checkpointing:
                block = blocks[index] = checkpoint_wrapper(block)
            if args.compile:
                block.compile()
            fully_shard(block, mesh=mesh, offload_policy=offload, mp_policy=precision)
        model = fully_shard(module.model, mesh=mesh, reshard_after_forward=False, offload_policy=offload,
                            mp_policy=precision)
    optimizer = module.configure_optimizers()

    def step(inputs, targets):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model, inputs, targets)
        loss.backward()
        optimizer.step()
        return loss.detach()
    return step


def _pipelined(args, module: GPTLanguageModel):
    """torch.distributed.pipelining's loop over this rank's stages of the GPT, FSDP inside each stage."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

    gpt, pp, per_rank = module.model, args.pipeline_parallel, args.stages_per_rank
    meshes = init_device_mesh("cpu" if args.device == "cpu" else "cuda", (pp, dist.get_world_size() // pp),
                              mesh_dim_names=("pipeline_parallel", "data_parallel"))
    pp_group, pp_rank = meshes["pipeline_parallel"].get_group(), meshes["pipeline_parallel"].get_local_rank()
    stages, per_stage = pp * per_rank, len(gpt.blocks) // (pp * per_rank)
    device = next(gpt.parameters()).device
    held, params, tied = [], [], []
    for index in range(pp_rank, stages, pp):
        last = index == stages - 1
        stage = _Stage(gpt, range(index * per_stage, (index + 1) * per_stage), first=index == 0, last=last,
                       head=copy.deepcopy(gpt.lm_head) if last else None)
        for block in stage.blocks:
            fully_shard(block, mesh=meshes["data_parallel"])
        fully_shard(stage, mesh=meshes["data_parallel"], reshard_after_forward=False)
        held.append(PipelineStage(stage, index, stages, device, group=pp_group))
        params += list(stage.parameters())
        tied += [stage.token_embedding.weight] if index == 0 else [stage.lm_head.weight] if index == stages - 1 else []
    module.model = torch.nn.Identity()  # the stages hold what this rank runs; the rest of the model goes

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    schedule_class = get_schedule_class(args.pipeline_schedule)
    multi = issubclass(schedule_class, PipelineScheduleMulti)
    schedule = schedule_class(held if multi else held[0], stages, loss_fn=loss_fn)  # a microbatch per stage
    # decay_groups' split: matrices decayed, embeddings (the head's copy among them) and vectors not.
    embeddings = {id(m.weight) for s in held for m in s.submod.modules() if isinstance(m, torch.nn.Embedding)}
    embeddings |= {id(weight) for weight in tied}
    decayed = [p for p in params if p.dim() >= 2 and id(p) not in embeddings]
    optimizer = module.optimizer_factory(params=[{"params": decayed}, {
        "params": [p for p in params if id(p) not in {id(d) for d in decayed}], "weight_decay": 0.0}])
    first_rank, last_rank = 0, (stages - 1) % pp

    def step(inputs, targets):
        optimizer.zero_grad(set_to_none=True)
        kwargs = {"target": targets, "losses": []} if pp_rank == last_rank else {}
        schedule.step(inputs, **kwargs) if pp_rank == first_rank else schedule.step(**kwargs)
        for weight in tied:  # the tied head's two copies take one summed gradient (pp_group holds both)
            dist.all_reduce(weight.grad.to_local(), group=pp_group)
        optimizer.step()
        return torch.stack(kwargs["losses"]).mean().detach() if "losses" in kwargs else None  # the microbatches' mean
    return step


class _Stage(torch.nn.Module):
    """The GPT's blocks `indices`, with its embeddings on the first stage and its final norm and head on the last."""

    def __init__(self, gpt, indices: range, first: bool, last: bool, head) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.blocks = torch.nn.ModuleList(gpt.blocks[i] for i in indices)
        if first:
            self.token_embedding, self.position_embedding = gpt.token_embedding, gpt.position_embedding
        if last:
            self.ln_out, self.lm_head = gpt.ln_out, head

    def forward(self, x):
        if self.first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.token_embedding(x) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_out(x)) if self.last else x


def _exchange_attention(gpt, cp: int) -> None:
    """Ulysses by hand: every block's attention exchanges sequence shards for head shards around SDPA, and the
    position embedding is read at this rank's shard of the positions."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(start, start + cp))) for start in range(0, world, cp)]
    group, cp_rank = groups[rank // cp], rank % cp

    def seq_to_heads(x):  # [B, t, H, D] -> [B, H/cp, cp * t, D]
        b, t, h, d = x.shape
        x = x.reshape(b, t, cp, h // cp, d).permute(2, 0, 1, 3, 4).contiguous()  # by destination: heads
        x = all_to_all_single_autograd(x.flatten(), None, None, group).view(cp, b, t, h // cp, d)
        return x.permute(1, 3, 0, 2, 4).reshape(b, h // cp, cp * t, d)  # by source: sequence chunks, in order

    def heads_to_seq(y):  # [B, H/cp, T, D] -> [B, t, H * D]
        b, hc, length, d = y.shape
        y = y.reshape(b, hc, cp, length // cp, d).permute(2, 0, 3, 1, 4).contiguous()  # by destination: chunks
        y = all_to_all_single_autograd(y.flatten(), None, None, group).view(cp, b, length // cp, hc, d)
        return y.permute(1, 2, 0, 3, 4).reshape(b, length // cp, cp * hc * d)  # by source: heads, in order

    def attention(self, x):
        batch, length, _ = x.shape
        q, k, v = (seq_to_heads(m(x).view(batch, length, -1, self.head_dim)) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(heads_to_seq(y))

    def embed(tokens):
        length = tokens.shape[1]
        positions = torch.arange(cp_rank * length, (cp_rank + 1) * length, device=tokens.device)
        return gpt.token_embedding(tokens) + gpt.position_embedding(positions)

    for block in gpt.blocks:
        block.attn.forward = attention.__get__(block.attn)
    gpt.embed = embed


def _split(block: torch.nn.Module, mesh) -> None:
    """Megatron-LM's split of one block, written out: q, k, v and the MLP's first layer by output features (whole
    heads per rank), the attention output and the MLP's second layer by input features; one all-reduce each."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(block, mesh, {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                                     "attn.proj": RowwiseParallel(), "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()})


if __name__ == "__main__":
    main()
