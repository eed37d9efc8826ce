"""The parallel dimensions of a run, as data: named axes and their sizes. How many ranks replicate the data-parallel
state and how many shard it, and how many split each layer (tensor parallel), each sequence (context parallel) or
the model's depth (pipeline stages). Everything that asks "how many data-parallel ranks are there, and which one am
I" (the sampler, throughput, the memory planner, data positions) asks this, never the world size: the ranks of one
tensor-, context- or pipeline-parallel group read the same batches.

An axis is a row of `ParallelDims.AXES`: its size is a field, and the rank layout, the data-parallel rank, the device
mesh and the sharding mesh follow from the table. Ranks are laid out as torchtitan lays them, in the table's order:
pipeline stages outermost, then replicate, shard and context parallel, tensor parallel innermost (the ranks of one
tensor-parallel group are neighbours, on one node). The device mesh keeps Lightning's axis names (`data_parallel`,
`tensor_parallel`, as its `ModelParallelStrategy` builds them) so that a `configure_model` written as Lightning's
documentation shows works under our strategies too.

No torch at import: the command line sizes a run from its config with this before anything loads torch
(lightning_dist/run/config_values.py), so an impossible layout is refused in one line in well under a second.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DATA_PARALLEL = "data_parallel"  # Lightning's name for the whole data-parallel axis
TENSOR_PARALLEL = "tensor_parallel"
DATA_PARALLEL_REPLICATE = "data_parallel_replicate"  # HSDP: across nodes
DATA_PARALLEL_SHARD = "data_parallel_shard"  # HSDP: within a node
CONTEXT_PARALLEL = "context_parallel"
PIPELINE_PARALLEL = "pipeline_parallel"
# What FSDP shards over once context parallelism folds its ranks in (torchtitan's `dp_shard_cp`).
DATA_PARALLEL_SHARD_CP = "data_parallel_shard_cp"
# Expert parallelism splits the shard axis in two (torchtitan's layout): the ranks left to each expert, which FSDP
# shards its weights over (outer), and the ranks that split each layer's experts (inner), with the context-parallel
# ranks when there are some (then the shard axis's part is `expert_parallel_shard`, flattened with them).
EXPERT_SHARD = "expert_shard"
EXPERT_PARALLEL = "expert_parallel"
EXPERT_PARALLEL_SHARD = "expert_parallel_shard"


@dataclass(frozen=True)
class Axis:
    """One parallel dimension: its size is the `ParallelDims` field `name`; `mesh_name` names it in the device mesh.
    `reads_data`: its ranks read different batches (a data-parallel axis). `shards_state`: FSDP shards parameters and
    optimizer state over it as well (context parallelism holds no weights of its own, so it lends its ranks)."""

    name: str
    mesh_name: str
    reads_data: bool = False
    shards_state: bool = False


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
    """The sizes of a run's parallel dimensions, one field per row of `AXES`; their product is the world size.
    `ep` is not a row: expert parallelism re-partitions the ranks FSDP shards over (`dp_shard` x `cp`)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1

    # Outermost first: the order ranks are laid out in, and the device mesh's. Room for more: a field and a row (an
    # axis that re-partitions another's ranks, as `ep` does the shard axis's, is a field only).
    AXES: ClassVar[tuple[Axis, ...]] = (
        Axis("pp", PIPELINE_PARALLEL),
        Axis("dp_replicate", DATA_PARALLEL_REPLICATE, reads_data=True),
        Axis("dp_shard", DATA_PARALLEL_SHARD, reads_data=True, shards_state=True),
        Axis("cp", CONTEXT_PARALLEL, shards_state=True),
        Axis("tp", TENSOR_PARALLEL),
    )

    def __post_init__(self) -> None:
        if {axis.name for axis in self.AXES} | {"ep"} != {field.name for field in fields(self)}:
            raise TypeError(f"{type(self).__name__}: one field per axis of AXES, and ep")
        for name, value in {**self.sizes, "ep": self.ep}.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelDims.{name}={value!r}: give a whole number of ranks, at least 1")
        if self.ep > 1 and (self.ep % self.cp or self.dp_shard % (self.ep // self.cp)):
            raise ValueError(f"ParallelDims.ep={self.ep}: expert parallelism takes each context-parallel group"
                             f" (cp={self.cp}) and some shard ranks (dp_shard={self.dp_shard}): a multiple of cp"
                             " that divides dp_shard x cp")

    @property
    def sizes(self) -> dict[str, int]:
        """Each axis's size, outermost first."""
        return {axis.name: getattr(self, axis.name) for axis in self.AXES}

    @classmethod
    def resolve(cls, world_size: int, **sizes: int) -> ParallelDims:
        """The dimensions of `world_size` ranks from some axes' sizes (the others are 1; dp_shard, unless given, is
        the ranks that are left); one size may be -1: "the ranks that are left" (torchtitan's and Accelerate's
        convention). Raises ValueError naming the sizes when they do not multiply to the world."""
        sizes = {"dp_shard": -1, **sizes} if "dp_shard" not in sizes else dict(sizes)
        ep = sizes.pop("ep", 1)  # it divides the shard axis, not the world
        unknown = [name for name, size in sizes.items() if size == -1]
        if len(unknown) > 1:
            raise ValueError(f"parallel sizes {sizes}: at most one may be -1 (the ranks that are left)")
        known = math.prod(size for name, size in sizes.items() if name not in unknown)
        if unknown:
            if known < 1 or world_size % known:
                raise ValueError(f"parallel sizes {sizes}: {world_size} ranks do not divide into groups of {known}")
            sizes[unknown[0]] = world_size // known
        dims = cls(**sizes, ep=ep)
        if dims.world_size != world_size:
            raise ValueError(
                f"parallel sizes {sizes} multiply to {dims.world_size} ranks, and the run has {world_size}"
            )
        return dims

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def dp_size(self) -> int:
        """Ranks that each see their own batches."""
        return math.prod(getattr(self, axis.name) for axis in self.AXES if axis.reads_data)

    def coordinates(self, global_rank: int) -> dict[str, int]:
        """Where `global_rank` is on each axis."""
        coordinates = {}
        for axis in reversed(self.AXES):  # innermost first
            global_rank, coordinates[axis.name] = divmod(global_rank, getattr(self, axis.name))
        return {axis.name: coordinates[axis.name] for axis in self.AXES}

    def dp_rank(self, global_rank: int) -> int:
        """Which data-parallel rank `global_rank` is: the ranks of one tensor-, context- or pipeline-parallel
        group share it."""
        rank, coordinates = 0, self.coordinates(global_rank)
        for axis in self.AXES:
            if axis.reads_data:
                rank = rank * getattr(self, axis.name) + coordinates[axis.name]
        return rank

    def expert_rank(self, global_rank: int) -> int:
        """Where `global_rank` is on the expert-parallel axis: the inner part of its place on the shard axis, then
        its place in its context-parallel group."""
        coordinates = self.coordinates(global_rank)
        return coordinates["dp_shard"] % (self.ep // self.cp) * self.cp + coordinates["cp"]

    def sampler_kwargs(self, global_rank: int) -> dict[str, int]:
        """`DistributedSampler`'s arguments: one share of the data per data-parallel rank."""
        return {"num_replicas": self.dp_size, "rank": self.dp_rank(global_rank)}

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """A device mesh over every rank with Lightning's axes, `data_parallel` and `tensor_parallel`, and every other
        axis larger than 1. When the data-parallel state is both replicated and sharded (HSDP), or context
        parallelism lends FSDP its ranks, or expert parallelism splits the shard axis, the data axes are there by
        their own names and `data_parallel` is them flattened; so is `data_parallel_shard_cp`, what FSDP shards
        over (and `expert_parallel`, the ranks that split the experts, under context parallelism). Flattened meshes
        are kept with the mesh (`flattened_mesh`): torch has deprecated slicing them from it."""
        kept = [axis for axis in self.AXES if getattr(self, axis.name) > 1 or axis.name in ("dp_shard", "tp")]
        one_data_axis = self.dp_replicate == 1 and self.cp == 1 and self.ep == 1
        dims = {axis.name: self._mesh_dims(axis, one_data_axis) for axis in kept}
        mesh = init_device_mesh(device_type, tuple(size for parts in dims.values() for size in parts.values()),
                                mesh_dim_names=tuple(name for parts in dims.values() for name in parts))
        if not one_data_axis:
            data = tuple(name for axis in kept if axis.reads_data for name in dims[axis.name])
            flattened = {DATA_PARALLEL: flatten_mesh_dims(mesh, data, DATA_PARALLEL)}
            if self.cp > 1:
                shards = tuple(name for axis in kept if axis.shards_state for name in dims[axis.name])
                flattened[DATA_PARALLEL_SHARD_CP] = flatten_mesh_dims(mesh, shards, DATA_PARALLEL_SHARD_CP)
                if self.ep > 1:
                    flattened[EXPERT_PARALLEL] = flatten_mesh_dims(mesh, (EXPERT_PARALLEL_SHARD, CONTEXT_PARALLEL),
                                                                   EXPERT_PARALLEL)
            _FLATTENED[mesh] = flattened
        return mesh

    def _mesh_dims(self, axis: Axis, one_data_axis: bool) -> dict[str, int]:
        """The mesh's dimensions for `axis`, by name: the shard axis is two under expert parallelism."""
        if axis.name == "dp_shard" and self.ep > 1:
            inside = self.ep // self.cp
            return {EXPERT_SHARD: self.dp_shard // inside, EXPERT_PARALLEL if self.cp == 1 else EXPERT_PARALLEL_SHARD:
                    inside}
        name = DATA_PARALLEL if one_data_axis and axis.name == "dp_shard" else axis.mesh_name
        return {name: getattr(self, axis.name)}

    def sharding_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The part of `mesh` that FSDP shards over: 1-D, or 2-D (replicate, shard) for HSDP, as `fully_shard`
        takes it; under context parallelism the shard axis is `data_parallel_shard_cp`."""
        if self.cp > 1:
            shard = DATA_PARALLEL_SHARD_CP
        else:
            shard = DATA_PARALLEL if self.dp_replicate == 1 else DATA_PARALLEL_SHARD
        if self.dp_replicate == 1:
            return flattened_mesh(mesh, shard)
        return mesh[DATA_PARALLEL_REPLICATE, shard]

    def expert_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The expert-parallel axis of `mesh` (1-D): the ranks that split each layer's experts."""
        return flattened_mesh(mesh, EXPERT_PARALLEL)

    def expert_sharding_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The part of `mesh` that FSDP shards the experts over: the ranks left to each expert."""
        return mesh[EXPERT_SHARD]


# The meshes `build_mesh` flattened, kept with the mesh they were flattened from (for as long as it lives).
_FLATTENED: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def flattened_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """`mesh[name]`, or the mesh `build_mesh` flattened under `name`, as it was returned then."""
    return _FLATTENED.get(mesh, {}).get(name) or mesh[name]


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
