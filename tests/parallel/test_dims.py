"""Named parallel dimensions (lightning_dist/parallel/dims.py), and what asks them for the data-parallel size."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from lightning_dist.callbacks.run_summary import throughput
from lightning_dist.data.pydoc_text import PydocTextDataModule
from lightning_dist.memory.layout import Layout
from lightning_dist.memory.model_facts import ModelFacts
from lightning_dist.memory.planner import plan_memory
from lightning_dist.models.gpt import GPTLanguageModel
from lightning_dist.parallel.dims import ParallelDims, parallel_dims_of
from lightning_dist.parallel.sizes import ParallelSizes
from tests.conftest import REPO
from tests.parallel.toy_axis import WithToyAxis

# (world size, sizes given, dimensions, data-parallel rank of each global rank)
LAYOUTS = [
    (4, {}, ParallelDims(dp_shard=4), [0, 1, 2, 3]),  # 1-D: FSDP over every rank
    (8, {"dp_replicate": 2}, ParallelDims(dp_replicate=2, dp_shard=4), list(range(8))),  # 2-D: HSDP
    (8, {"tp": 2}, ParallelDims(dp_shard=4, tp=2), [0, 0, 1, 1, 2, 2, 3, 3]),  # 2-D: FSDP x TP, half the world
    (8, {"dp_replicate": 2, "tp": 2}, ParallelDims(2, 2, 2), [0, 0, 1, 1, 2, 2, 3, 3]),  # 3-D: HSDP x TP
    (8, {"dp_replicate": -1, "dp_shard": 2, "tp": 2}, ParallelDims(2, 2, 2), [0, 0, 1, 1, 2, 2, 3, 3]),
]


@pytest.mark.parametrize(("world", "sizes", "dims", "dp_ranks"), LAYOUTS)
def test_resolved_layouts_and_each_ranks_share_of_the_data(world, sizes, dims, dp_ranks):
    assert ParallelDims.resolve(world, **sizes) == dims
    assert dims.world_size == world and dims.dp_size == world // dims.tp
    assert [dims.sampler_kwargs(rank) for rank in range(world)] == [
        {"num_replicas": dims.dp_size, "rank": dp_rank} for dp_rank in dp_ranks
    ]


@pytest.mark.parametrize(("world", "sizes", "message"), [
    (6, {"tp": 4}, "6 ranks do not divide into groups of 4"),
    (8, {"dp_replicate": -1, "tp": -1}, "at most one may be -1"),
    (8, {"dp_replicate": 2, "dp_shard": 2, "tp": 1}, "multiply to 4 ranks, and the run has 8"),
])
def test_sizes_that_do_not_fit_the_world_are_refused_naming_them(world, sizes, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims.resolve(world, **sizes)


def test_a_size_below_one_is_refused():
    with pytest.raises(ValueError, match=r"ParallelDims.tp=0: give a whole number of ranks, at least 1"):
        ParallelDims(tp=0)


MESHES = textwrap.dedent("""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from lightning_dist.parallel.dims import ParallelDims, flattened_mesh
    from tests.parallel.toy_axis import WithToyAxis
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    for dims in (ParallelDims(dp_shard=4, tp=2), ParallelDims(2, 2, 2), ParallelDims(dp_shard=2, cp=2, tp=2),
                 WithToyAxis(dp_shard=2, toy=2, tp=2)):
        mesh = dims.build_mesh("cpu")
        sharding = dims.sharding_mesh(mesh)
        data_parallel = flattened_mesh(mesh, "data_parallel")
        print(mesh.mesh_dim_names, data_parallel.size(), data_parallel.get_local_rank(),
              mesh["tensor_parallel"].size(), sharding.mesh_dim_names, sharding.size())
""")


def test_meshes_keep_lightnings_axis_names_seen_from_rank_5_of_8():
    # A fake process group: collectives complete without peers, so 8 ranks' meshes can be built in one process.
    done = subprocess.run([sys.executable, "-c", MESHES], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-4:] == [
        "('data_parallel', 'tensor_parallel') 4 2 2 ('data_parallel',) 4",
        "('data_parallel_replicate', 'data_parallel_shard', 'tensor_parallel') 4 2 2"
        " ('data_parallel_replicate', 'data_parallel_shard') 4",
        # Context parallelism lends FSDP its ranks: rank 5 is (shard 1, cp 0, tp 1); FSDP shards over 2 x 2.
        "('data_parallel_shard', 'context_parallel', 'tensor_parallel') 2 1 2 ('data_parallel_shard_cp',) 4",
        "('data_parallel', 'toy_parallel', 'tensor_parallel') 2 1 2 ('data_parallel',) 2",
    ]


def test_a_new_axis_is_a_field_and_a_row():
    """A toy axis (tests/parallel/toy_axis.py) is laid out, shares the data and is checked as the others are."""
    dims = WithToyAxis.resolve(16, toy=2, tp=2)
    assert dims == WithToyAxis(dp_shard=4, toy=2, tp=2) and (dims.world_size, dims.dp_size) == (16, 4)
    assert dims.coordinates(13) == {"pp": 0, "dp_replicate": 0, "dp_shard": 3, "cp": 0, "toy": 0, "tp": 1}
    assert [dims.sampler_kwargs(rank)["rank"] for rank in range(16)] == [rank // 4 for rank in range(16)]
    with pytest.raises(ValueError, match=r"ParallelDims.toy=0: give a whole number of ranks"):
        WithToyAxis(toy=0)
    with pytest.raises(ValueError, match="16 ranks do not divide into groups of 6"):
        WithToyAxis.resolve(16, toy=3, tp=2)


def _strategy(dims: ParallelDims) -> SimpleNamespace:
    return SimpleNamespace(parallel_dims=dims, world_size=dims.world_size)


def test_any_strategy_says_its_dimensions():
    assert parallel_dims_of(_strategy(ParallelDims(dp_shard=2, tp=2))) == ParallelDims(dp_shard=2, tp=2)
    # Lightning's own strategies: what their sampler is told (DDP: every rank; its ModelParallelStrategy: dp only).
    lightning_ddp = SimpleNamespace(world_size=4, distributed_sampler_kwargs={"num_replicas": 4, "rank": 3})
    lightning_2d = SimpleNamespace(world_size=4, distributed_sampler_kwargs={"num_replicas": 2, "rank": 1})
    assert parallel_dims_of(lightning_ddp) == ParallelDims(dp_replicate=4)
    assert parallel_dims_of(lightning_2d) == ParallelDims(dp_replicate=2, tp=2)
    assert parallel_dims_of(SimpleNamespace()) == ParallelDims()  # a single device


def test_the_sampler_shares_the_data_among_data_parallel_ranks_only():
    data = PydocTextDataModule(batch_size=2)
    data.setup("fit")
    loop = SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=SimpleNamespace(current=SimpleNamespace(processed=0))))
    # Global rank 3 of 4, tensor-parallel size 2: data-parallel rank 1 of 2.
    data.trainer = SimpleNamespace(strategy=_strategy(ParallelDims(dp_shard=2, tp=2)), global_rank=3, world_size=4,
                                   current_epoch=0, fit_loop=loop)
    sampler = data.train_dataloader().sampler
    assert (sampler.num_replicas, sampler.rank) == (2, 1)
    assert len(sampler) == math.ceil(len(data.train_set) / 2)


def test_throughput_counts_the_batches_of_data_parallel_ranks():
    # 4 ranks, tensor parallel in pairs: two batches of 8 x 128 tokens per step of 2 s.
    dims = ParallelDims(dp_shard=2, tp=2)
    assert throughput((8, 128), dims.dp_size, 2.0) == {"samples_per_s": 8.0, "tokens_per_s": 1024.0}


def test_the_planner_divides_state_by_the_ranks_that_hold_parts_of_it():
    facts = ModelFacts.of(GPTLanguageModel)
    n = facts.parameters
    replicated, sharded = Layout("ddp", "torch"), Layout("fsdp", "torch", True, True, True)
    hybrid = Layout("hsdp", "torch", True, True, True, sizes=ParallelSizes(hybrid=True))
    # 4 ranks: DDP holds everything; with tensor parallelism in pairs each rank holds half of each split layer
    # (the plan's: attention and MLP), and the rest (embeddings, norms, the MLP's second bias) whole.
    split = facts.tensor_parallel_parameters
    assert 0.8 * n < split < n
    assert plan_memory(facts, replicated, devices=4).device["parameters"] == n * 4
    assert plan_memory(facts, replicated, devices=4, dims=ParallelDims(dp_replicate=2, tp=2)).device["parameters"] == (n - split + math.ceil(split / 2)) * 4
    # FSDP shards over all 4; HSDP on 2 nodes of 2 shards within a node only.
    assert plan_memory(facts, sharded, devices=2, num_nodes=2).device["parameters"] == math.ceil(n * 4 / 4)
    assert plan_memory(facts, hybrid, devices=2, num_nodes=2).device["parameters"] == math.ceil(n * 4 / 2)
    assert plan_memory(facts, sharded, devices=2, dims=ParallelDims(dp_shard=1, tp=2)).device["parameters"] == (n - split + math.ceil(split / 2)) * 4
