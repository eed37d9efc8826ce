"""ZeRO's settings, typed, and every rule about them, written once.

The same settings arrive two ways: as the strategy's options (`strategy.stage`, `strategy.offload_parameters`, ...)
and as a config file's `zero_optimization` section. `ZeroSection.of(config)` reads the section once, for everything
that needs to know the stage or where state is offloaded (the constructor, the resolver, the pre-launch check, the
memory planner, the checkpoint loader, the buffer sizing). The rules below are checked on both: each one has one
message, which names the keys as the user wrote them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ZERO_STAGES = (1, 2, 3)
# ZeRO-3's optimizer tile (`sub_group_size`), in elements: the optimizer steps on one flat fp32 group at a time,
# with a gradient copy and Adam's temporaries the size of the group. Lightning's 1e12 makes a rank's whole
# partition one group: 2.4 GB of transients per rank for a 400M-parameter model in fp32 and, under NVMe offload,
# the whole optimizer partition swapped in at once (over 12 GB of host memory per rank for 2B parameters).
# 2.5e7: 0.3 GB of transients, 0.4 GB per group swapped in.
OPTIMIZER_TILE = 25_000_000
OFFLOAD_DEVICES = ("cpu", "nvme")
SECTION = "zero_optimization"
# The section's blocks for each kind of offloaded state.
OPTIMIZER_BLOCK, PARAMETER_BLOCK = "offload_optimizer", "offload_param"


@dataclass(frozen=True)
class Offload:
    """Where one kind of state lives between uses: None (the accelerator), "cpu" or "nvme" (with its directory)."""

    device: str | None = None
    nvme_path: str | None = None

    @classmethod
    def of(cls, block: Any) -> Offload:
        block = block if isinstance(block, Mapping) else {}
        device = block.get("device")
        return cls(None if device in (None, "none") else device, block.get("nvme_path"))


@dataclass(frozen=True)
class ZeroSection:
    """A config's `zero_optimization`, typed. `stage` is 0 when the section leaves it out (DeepSpeed's default);
    it keeps an unresolved "auto" as it is."""

    stage: Any = 0
    optimizer: Offload = field(default_factory=Offload)
    parameters: Offload = field(default_factory=Offload)

    @classmethod
    def of(cls, config: Mapping[str, Any] | None) -> ZeroSection:
        zero = (config or {}).get(SECTION) or {}
        return cls(zero.get("stage", 0), Offload.of(zero.get(OPTIMIZER_BLOCK)), Offload.of(zero.get(PARAMETER_BLOCK)))

    @property
    def partitions_parameters(self) -> bool:
        return self.stage == 3

    @property
    def offloads_optimizer(self) -> bool:
        return self.optimizer.device is not None

    @property
    def offloads_to_host(self) -> bool:
        """Optimizer state or parameters in host memory (NVMe is staged through host memory too)."""
        return bool({self.optimizer.device, self.parameters.device} & set(OFFLOAD_DEVICES))

    def nvme_paths(self) -> dict[str, str | None]:
        """{config key: directory} of each offload that goes to NVMe."""
        return {
            f"{SECTION}.{block}.nvme_path": offload.nvme_path
            for block, offload in ((OPTIMIZER_BLOCK, self.optimizer), (PARAMETER_BLOCK, self.parameters))
            if offload.device == "nvme"
        }

    def problems(self) -> list[str]:
        """The rules, on a config file's section (the strategy's options are checked by `option_problems`)."""
        found = [stage_problem(self.stage, f"{SECTION}.stage")] if self.stage not in (0, "auto") else []
        found += [device_problem(offload.device, f"{SECTION}.{block}.device")
                  for block, offload in ((OPTIMIZER_BLOCK, self.optimizer), (PARAMETER_BLOCK, self.parameters))]
        found.append(
            parameter_offload_problem(
                self.stage, self.parameters.device, f"{SECTION}.stage", f"{SECTION}.{PARAMETER_BLOCK}"
            )
        )
        found += [
            nvme_path_problem(key, path, f"{key} or strategy.nvme_path") for key, path in self.nvme_paths().items()
        ]
        return [problem for problem in found if problem]


def option_problems(stage: int | None, offload_optimizer: str | None, offload_parameters: str | None,
                    nvme_path: str | None, with_config: bool) -> list[str]:
    """The rules, on the strategy's own options. A None stage leaves it to the config file (or 2 without one);
    with a file, its NVMe paths may stand in for `strategy.nvme_path`, and the two are compared when the run starts."""
    found = [stage_problem(stage, "strategy.stage")] if stage is not None else []
    found += [device_problem(offload_optimizer, "strategy.offload_optimizer"),
              device_problem(offload_parameters, "strategy.offload_parameters")]
    if stage is not None:
        found.append(
            parameter_offload_problem(stage, offload_parameters, "strategy.stage", "strategy.offload_parameters")
        )
    if not with_config and "nvme" in (offload_optimizer, offload_parameters):
        found.append(nvme_path_problem("strategy.nvme_path", nvme_path, "strategy.nvme_path"))
    return [problem for problem in found if problem]


def stage_problem(stage: Any, key: str) -> str | None:
    if stage in ZERO_STAGES:
        return None
    return f"{key}: {stage!r} is not a ZeRO stage; choose one of {', '.join(map(str, ZERO_STAGES))}"


def device_problem(device: str | None, key: str) -> str | None:
    if device is None or device in OFFLOAD_DEVICES:
        return None
    return f"{key}: {device!r} is not an offload device; choose one of null, {', '.join(OFFLOAD_DEVICES)}"


def parameter_offload_problem(stage: Any, device: str | None, stage_key: str, offload_key: str) -> str | None:
    """ZeRO offloads parameters only where it partitions them."""
    if device is None or stage in (3, "auto"):
        return None
    return (f"{offload_key}: parameter offload needs ZeRO stage 3, got {stage_key}={stage};"
            f" choose {stage_key}=3 or {offload_key}=null")


def nvme_path_problem(key: str, path: str | None, where: str) -> str | None:
    return None if path else nvme_path_missing(key, where)


def nvme_path_missing(key: str, where: str) -> str:
    return f"{key}: NVMe offload needs a directory to offload to; set {where}"
