"""The configured parallel sizes as one value (lightning_dist/parallel/sizes.py): read from a strategy's keys with
the strategy's own defaults, laid over the ranks, refused in one line naming the keys."""

from __future__ import annotations

import inspect

import pytest

from lightning_dist.parallel.dims import ParallelDims
from lightning_dist.parallel.sizes import DEFAULT_SIZES, ParallelSizes


def test_the_fsdp_strategy_takes_its_default_sizes_from_the_value():
    from lightning_dist.strategies import FSDPStrategy

    defaults = inspect.signature(FSDPStrategy).parameters
    assert {name: defaults[key.removeprefix("strategy.")].default for name, key in ParallelSizes.KEYS.items()} == {
        "pipeline": DEFAULT_SIZES.pipeline, "context": DEFAULT_SIZES.context, "tensor": DEFAULT_SIZES.tensor,
        "replicate": DEFAULT_SIZES.replicate, "expert": DEFAULT_SIZES.expert}
    assert FSDPStrategy().parallel_sizes == DEFAULT_SIZES
    assert FSDPStrategy(sharding_strategy="hybrid_shard", tensor_parallel_size=2, context_parallel_size=2).parallel_sizes \
        == ParallelSizes(tensor=2, context=2, hybrid=True)


def test_a_config_section_gives_the_sizes_it_sets_and_the_defaults_for_the_rest():
    assert ParallelSizes.from_config({}) == DEFAULT_SIZES
    section = {"sharding_strategy": "HYBRID_SHARD", "tensor_parallel_size": 2, "data_parallel_replicate_size": None,
               "pipeline_parallel_size": 4, "context_parallel_size": 1}
    assert ParallelSizes.from_config(section) == ParallelSizes(tensor=2, pipeline=4, hybrid=True)
    with pytest.raises(ValueError, match=r"^strategy\.sharding_strategy: 'zero' is not supported; choose one of FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD$"):
        ParallelSizes.from_config({"sharding_strategy": "zero"})


@pytest.mark.parametrize(("sizes", "devices", "nodes", "dims"), [
    (DEFAULT_SIZES, 4, 1, ParallelDims(dp_shard=4)),
    (ParallelSizes(tensor=2, context=2), 8, 1, ParallelDims(dp_shard=2, cp=2, tp=2)),
    (ParallelSizes(hybrid=True), 2, 2, ParallelDims(dp_replicate=2, dp_shard=2)),  # one replica per node
    (ParallelSizes(replicate=-1, tensor=2), 4, 2, ParallelDims(dp_replicate=4, tp=2)),  # the ranks left replicate
    (ParallelSizes(pipeline=2, tensor=2), 8, 1, ParallelDims(pp=2, dp_shard=2, tp=2)),
])
def test_sizes_are_laid_over_the_ranks(sizes, devices, nodes, dims):
    assert sizes.check(devices, nodes) == sizes.dims(devices, nodes) == dims


def test_sizes_that_do_not_fit_the_ranks_are_one_line_naming_the_keys_set():
    with pytest.raises(ValueError) as raised:
        ParallelSizes(tensor=2, pipeline=3, replicate=1).check(4, 1)
    assert str(raised.value) == ("strategy.pipeline_parallel_size=3, strategy.tensor_parallel_size=2,"
                                 " strategy.data_parallel_replicate_size=1: the run's 4 ranks (trainer.devices x"
                                 " trainer.num_nodes) do not divide into groups of these sizes")
    with pytest.raises(ValueError, match=r"^strategy\.tensor_parallel_size=4: tensor parallelism splits each layer"
                                         r" over ranks of one node, and a node runs 2 \(trainer\.devices\)"):
        ParallelSizes(tensor=4).check(2, 2)
