"""The parallel dimensions of a run, as data: how many ranks replicate the data-parallel state, how many shard it,
and how many split each layer (tensor parallel). Everything that asks "how many data-parallel ranks are there, and
which one am I" (the sampler, throughput, the memory planner, data positions) asks this, never the world size:
under tensor parallelism a batch is shared by the ranks of one tensor-parallel group.

Ranks are laid out as torchtitan lays them: replicate outermost, tensor parallel innermost (the ranks of one
tensor-parallel group are neighbours, on one node). The device mesh keeps Lightning's axis names
(`data_parallel`, `tensor_parallel`, as its `ModelParallelStrategy` builds them) so that a `configure_model`
written as Lightning's documentation shows works under our strategies too.

No torch at import: the command line sizes a run from its config with this before anything loads torch
(lightning_dist/run/config_values.py), so an impossible layout is refused in one line in well under a second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DATA_PARALLEL = "data_parallel"  # Lightning's name for the whole data-parallel axis
TENSOR_PARALLEL = "tensor_parallel"
DATA_PARALLEL_REPLICATE = "data_parallel_replicate"  # HSDP: across nodes
DATA_PARALLEL_SHARD = "data_parallel_shard"  # HSDP: within a node

# FSDP1 sharding-strategy names and what they mean for FSDP2: whether to free gathered parameters after forward
# (ZeRO-3 style) or keep them until backward (ZeRO-2 style), and whether shards are replicated across nodes.
SHARDING_STRATEGIES: dict[str, tuple[bool, bool]] = {
    # name: (reshard_after_forward, hybrid)
    "FULL_SHARD": (True, False),
    "SHARD_GRAD_OP": (False, False),
    "HYBRID_SHARD": (True, True),
}


def sharding_layout(name: str) -> tuple[bool, bool]:
    """(reshard_after_forward, hybrid) for an FSDP sharding-strategy name; a clear error for any other name."""
    try:
        return SHARDING_STRATEGIES[str(name).upper()]
    except KeyError:
        raise ValueError(
            f"strategy.sharding_strategy: {name!r} is not supported; choose one of {', '.join(SHARDING_STRATEGIES)}"
        ) from None


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of a run's parallel dimensions; their product is the world size. Context and pipeline
    parallelism are not offered yet: when they are, they become fields here, and nothing that asks for the
    data-parallel size changes."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelDims.{name}={value!r}: give a whole number of ranks, at least 1")

    @classmethod
    def resolve(cls, world_size: int, dp_replicate: int = 1, dp_shard: int = -1, tp: int = 1) -> ParallelDims:
        """The dimensions of `world_size` ranks, one of which may be -1: "the ranks that are left" (torchtitan's
        and Accelerate's convention). Raises ValueError naming the sizes when they do not multiply to the world."""
        sizes = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp}
        unknown = [name for name, size in sizes.items() if size == -1]
        if len(unknown) > 1:
            raise ValueError(f"parallel sizes {sizes}: at most one may be -1 (the ranks that are left)")
        known = 1
        for name, size in sizes.items():
            if name not in unknown:
                known *= size
        if unknown:
            if known < 1 or world_size % known:
                raise ValueError(f"parallel sizes {sizes}: {world_size} ranks do not divide into groups of {known}")
            sizes[unknown[0]] = world_size // known
        dims = cls(**sizes)
        if dims.world_size != world_size:
            raise ValueError(
                f"parallel sizes {sizes} multiply to {dims.world_size} ranks, and the run has {world_size}"
            )
        return dims

    @classmethod
    def of_sharding(cls, world_size: int, num_nodes: int, tp: int = 1, dp_replicate: int | None = None,
                    hybrid: bool = False) -> ParallelDims:
        """FSDP's dimensions: `tp` ranks split each layer, `dp_replicate` groups replicate the sharded state
        (unset: one per node under HYBRID_SHARD, else 1), and the ranks that are left shard it. One of `tp` and
        `dp_replicate` may be -1, the ranks that are left; then nothing else is left to shard over."""
        if dp_replicate is None:
            dp_replicate = num_nodes if hybrid else 1
        dp_shard = 1 if -1 in (dp_replicate, tp) else -1
        return cls.resolve(world_size, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp_size(self) -> int:
        """Ranks that each see their own batches."""
        return self.dp_replicate * self.dp_shard

    def dp_rank(self, global_rank: int) -> int:
        """Which data-parallel rank `global_rank` is: the ranks of one tensor-parallel group share it."""
        return global_rank // self.tp

    def sampler_kwargs(self, global_rank: int) -> dict[str, int]:
        """`DistributedSampler`'s arguments: one share of the data per data-parallel rank."""
        return {"num_replicas": self.dp_size, "rank": self.dp_rank(global_rank)}

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """A device mesh over every rank with Lightning's axes, `data_parallel` x `tensor_parallel`; when the
        data-parallel state is both replicated and sharded (HSDP), `data_parallel` is the flattened
        `data_parallel_replicate` x `data_parallel_shard`, and those two axes are there as well."""
        if self.dp_replicate == 1:
            return init_device_mesh(
                device_type, (self.dp_shard, self.tp), mesh_dim_names=(DATA_PARALLEL, TENSOR_PARALLEL)
            )
        mesh = init_device_mesh(
            device_type, (self.dp_replicate, self.dp_shard, self.tp),
            mesh_dim_names=(DATA_PARALLEL_REPLICATE, DATA_PARALLEL_SHARD, TENSOR_PARALLEL),
        )
        flatten_mesh_dims(mesh, (DATA_PARALLEL_REPLICATE, DATA_PARALLEL_SHARD), DATA_PARALLEL)
        return mesh

    def sharding_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The part of `mesh` that FSDP shards over: 1-D, or 2-D (replicate, shard) for HSDP, as `fully_shard`
        takes it."""
        if self.dp_replicate == 1:
            return mesh[DATA_PARALLEL]
        return mesh[DATA_PARALLEL_REPLICATE, DATA_PARALLEL_SHARD]


def parallel_dims_of(strategy: Any) -> ParallelDims:
    """The dimensions of any strategy's run: ours say theirs (`parallel_dims`); for others (Lightning's own, a
    user's), what their data sampler is told, which Lightning sets for every strategy it ships."""
    dims = getattr(strategy, "parallel_dims", None)
    if isinstance(dims, ParallelDims):
        return dims
    world_size = getattr(strategy, "world_size", 1) or 1
    replicas = (getattr(strategy, "distributed_sampler_kwargs", None) or {}).get("num_replicas", world_size)
    return ParallelDims.resolve(world_size, dp_replicate=replicas, dp_shard=1, tp=-1)


def init_device_mesh(*args: Any, **kwargs: Any) -> DeviceMesh:
    """torch's, imported when a mesh is built (this module loads no torch); a name of this module, where tests
    put a CUDA mesh's stand-in."""
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

    return torch_init_device_mesh(*args, **kwargs)


def flatten_mesh_dims(*args: Any, **kwargs: Any) -> Any:
    from lightning_dist._compat.torch import flatten_mesh_dims as fenced

    return fenced(*args, **kwargs)


def check_sharding_sizes(devices: int, num_nodes: int, tp: int, dp_replicate: int | None, hybrid: bool) -> ParallelDims:
    """FSDP's dimensions for `devices` x `num_nodes` ranks, or ValueError in one line naming the keys: the sizes
    must divide the ranks, and a tensor-parallel group must fit the ranks of one node."""
    sizes = f"strategy.tensor_parallel_size={tp}"
    if dp_replicate is not None:
        sizes += f", strategy.data_parallel_replicate_size={dp_replicate}"
    try:
        dims = ParallelDims.of_sharding(devices * num_nodes, num_nodes, tp, dp_replicate, hybrid)
    except ValueError as error:
        raise ValueError(f"{sizes}: the run's {devices * num_nodes} ranks (trainer.devices x trainer.num_nodes) do"
                         " not divide into groups of these sizes") from error
    if devices % dims.tp:
        raise ValueError(f"strategy.tensor_parallel_size={dims.tp}: tensor parallelism splits each layer over ranks"
                         f" of one node, and a node runs {devices} (trainer.devices); choose a size that divides it")
    return dims
