"""The parallel sizes a run is configured with, as one value: what the strategy's keys say (`strategy.*_size`, the
sharding strategy's replication across nodes) before the ranks are known. The config check before launch reads them
from the YAML section (`from_config`), the FSDP strategy from its arguments, the memory planner from the strategy's
layout; `dims` lays them over a world of ranks (parallel/dims.py), `check` does so with one-line errors naming the
keys. The defaults are the fields' own: the strategy's arguments take theirs from here.

No torch at import: the command line checks a config with this before anything loads torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar

from lightning_dist.parallel.dims import ParallelDims, sharding_layout


@dataclass(frozen=True)
class ParallelSizes:
    """`tensor`, `context` and `pipeline`: ranks that split each layer, each sequence and the model's depth (1:
    none). `replicate`: groups that replicate the sharded state (HSDP); None: one per node under `hybrid`
    (HYBRID_SHARD), else 1. One of `tensor` and `replicate` may be -1: the ranks that are left (then nothing else is
    left to shard over). The ranks left by all of them shard the state. `expert`: ranks among those that split each
    mixture-of-experts layer's experts (expert parallelism; it divides them)."""

    tensor: int = 1
    context: int = 1
    pipeline: int = 1
    replicate: int | None = None
    hybrid: bool = False
    expert: int = 1

    # Each field's key in a strategy's config, in the order a refusal names them.
    KEYS: ClassVar[dict[str, str]] = {
        "pipeline": "strategy.pipeline_parallel_size",
        "context": "strategy.context_parallel_size",
        "tensor": "strategy.tensor_parallel_size",
        "replicate": "strategy.data_parallel_replicate_size",
        "expert": "strategy.expert_parallel_size",
    }

    @classmethod
    def from_config(cls, strategy: Mapping[str, Any]) -> ParallelSizes:
        """The sizes a strategy's config section gives (its keys without the `strategy.` prefix; the defaults for
        those it leaves out). ValueError naming the key for a sharding strategy we do not know."""
        given = {name: strategy[key.removeprefix("strategy.")] for name, key in cls.KEYS.items()
                 if strategy.get(key.removeprefix("strategy.")) is not None}
        hybrid = sharding_layout(strategy.get("sharding_strategy") or "FULL_SHARD")[1]
        return cls(**given, hybrid=hybrid)

    def named(self) -> str:
        """The sizes set, as their keys: `strategy.context_parallel_size=2, strategy.tensor_parallel_size=2`
        (the tensor-parallel size always: it is the one every layout has)."""
        defaults = {field.name: field.default for field in fields(self)}
        return ", ".join(f"{key}={getattr(self, name)}" for name, key in self.KEYS.items()
                         if name == "tensor" or getattr(self, name) != defaults[name])

    def dims(self, devices: int, num_nodes: int) -> ParallelDims:
        """These sizes over `devices` x `num_nodes` ranks; ValueError where they do not multiply into them."""
        replicate = self.replicate if self.replicate is not None else (num_nodes if self.hybrid else 1)
        shard = 1 if -1 in (replicate, self.tensor) else -1
        return ParallelDims.resolve(devices * num_nodes, pp=self.pipeline, dp_replicate=replicate, dp_shard=shard,
                                    cp=self.context, tp=self.tensor, ep=self.expert)

    def check(self, devices: int, num_nodes: int) -> ParallelDims:
        """`dims`, or ValueError in one line naming the keys: the sizes must divide the ranks, a tensor-parallel
        group must fit the ranks of one node, and an expert-parallel group the ranks FSDP shards over."""
        try:
            dims = replace(self, expert=1).dims(devices, num_nodes)
        except ValueError as error:
            raise ValueError(f"{self.named()}: the run's {devices * num_nodes} ranks (trainer.devices x"
                             " trainer.num_nodes) do not divide into groups of these sizes") from error
        if devices % dims.tp:
            raise ValueError(f"strategy.tensor_parallel_size={dims.tp}: tensor parallelism splits each layer over"
                             f" ranks of one node, and a node runs {devices} (trainer.devices); choose a size that"
                             " divides it")
        if self.expert != 1:
            self._check_expert(dims.dp_shard, dims.cp)
            dims = replace(dims, ep=self.expert)
        return dims

    def _check_expert(self, shard: int, context: int) -> None:
        key = self.KEYS["expert"]
        beside = [f"{self.KEYS[name]}={getattr(self, name)}" for name in ("pipeline", "replicate")
                  if getattr(self, name) not in (1, None)]
        if self.hybrid:
            beside.append("strategy.sharding_strategy=HYBRID_SHARD")
        if beside:
            raise ValueError(f"{key}={self.expert}: expert parallelism does not run beside {beside[0]} yet")
        ranks = shard * context
        if isinstance(self.expert, bool) or not isinstance(self.expert, int) or self.expert < 1 or ranks % self.expert:
            raise ValueError(f"{key}={self.expert}: expert parallelism splits the experts over ranks among the"
                             f" {ranks} that FSDP shards each parameter over; choose a size that divides {ranks}")
        if self.expert % context:
            raise ValueError(f"{key}={self.expert}: an expert-parallel group takes in whole context-parallel groups"
                             f" ({self.KEYS['context']}={context}); choose a multiple of {context}")


DEFAULT_SIZES = ParallelSizes()
