"""Can this machine run a DeepSpeed config's offload? Checked before spawning, with what to install if not."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_dist.lifecycle.writable import unwritable_because
from lightning_dist.strategies.deepspeed.config.zero import ZeroSection

# DeepSpeed's native ops for offload, JIT-compiled on first use, and what makes them buildable.
INSTALL_HINTS = {
    "CPUAdamBuilder": "install a C++ compiler and Python headers (apt-get install build-essential python3-dev)",
    "AsyncIOBuilder": (
        "install libaio's headers (apt-get install libaio-dev on Debian/Ubuntu, yum install libaio-devel on RHEL);"
        " `ds_report` then shows async_io [OKAY]"
    ),
}


def nvme_paths(config: dict[str, Any]) -> dict[str, str | None]:
    """{config key: directory} of each offload that goes to NVMe."""
    return ZeroSection.of(config).nvme_paths()


def native_ops_needed(config: dict[str, Any]) -> list[str]:
    zero = ZeroSection.of(config)
    return [
        name
        for name, needed in (("CPUAdamBuilder", zero.offloads_optimizer), ("AsyncIOBuilder", bool(zero.nvme_paths())))
        if needed
    ]


def check_offload_ready(config: dict[str, Any]) -> None:
    """Raise ValueError naming every NVMe directory that cannot be written and every native op that does not load."""
    problems = [problem for key, path in nvme_paths(config).items() if (problem := _directory_problem(key, path))]
    builders = [_op_builder(name) for name in native_ops_needed(config)]
    problems += [problem for builder in builders if (problem := _unbuildable(builder))]
    # A first build takes minutes: only once nothing else is left to fix (the H200 of 2026-12-04 built CPU Adam for
    # a run that then stopped for want of libaio's headers).
    if not problems:
        problems += [problem for builder in builders if (problem := _build_problem(builder))]
    if problems:
        raise ValueError("offload cannot start: " + " | ".join(problems))


def _directory_problem(key: str, path: str | None) -> str | None:
    if not path:
        return f"{key}: NVMe offload needs a directory; set strategy.nvme_path"
    if not Path(path).is_dir():
        return f"{key}={path}: no such directory (create it on the NVMe drive, or point strategy.nvme_path elsewhere)"
    if why := unwritable_because(path):
        return f"{key}={path}: not writable ({why})"
    return None


def _op_builder(builder_name: str) -> tuple[str, Any]:
    from deepspeed.accelerator import get_accelerator

    from lightning_dist._compat.deepspeed import remember_cpu_info

    remember_cpu_info()  # asked here once, for this process and the ranks it starts
    return builder_name, get_accelerator().create_op_builder(builder_name)


def _unbuildable(named_builder: tuple[str, Any]) -> str | None:
    from deepspeed.accelerator import get_accelerator

    builder_name, builder = named_builder
    if builder is None:
        return f"DeepSpeed has no {builder_name} for the {get_accelerator().device_name()} accelerator"
    if not builder.is_compatible(verbose=False):
        return f"DeepSpeed's {builder.NAME} op cannot be built here: {INSTALL_HINTS[builder_name]}"
    return None


def _build_problem(named_builder: tuple[str, Any]) -> str | None:
    from lightning_dist._compat.deepspeed import say_on_local_rank_zero
    from lightning_dist.lifecycle.op_builds import announce_op_builds

    builder_name, builder = named_builder
    announce_op_builds(say_on_local_rank_zero)  # a first build takes minutes: say so before it starts
    try:
        builder.load(verbose=False)
    except Exception as error:  # noqa: BLE001 - a compiler or linker failure; its text goes into the message
        return (
            f"DeepSpeed's {builder.NAME} op failed to build ({type(error).__name__}: "
            f"{' '.join(str(error).split())[:300]}): {INSTALL_HINTS[builder_name]}"
        )
    return None


def check_before_launch(resolution: Callable[..., Any], trainer: Any, fit_arguments: dict[str, Any]) -> None:
    """What the DeepSpeed strategy checks on the launching process: the config resolved with what is known before
    `setup` (`resolution(trainer, model, loader, datamodule, in_rank=False)`), its offload, and an optimizer that
    steps partitions. Raises ValueError naming what to change."""
    from lightning.pytorch import LightningDataModule

    from lightning_dist.optim import require_shardable_optimizer

    loader, datamodule = fit_arguments.get("train_dataloaders"), fit_arguments.get("datamodule")
    if isinstance(loader, LightningDataModule):
        loader, datamodule = None, loader
    if loader is not None and not hasattr(loader, "batch_sampler"):
        loader = None  # a list or dict of loaders: the in-rank pass reads the combined one
    resolved = resolution(trainer, fit_arguments.get("model"), loader, datamodule, in_rank=False).config
    check_offload_ready(resolved)
    stage = ZeroSection.of(resolved).stage
    if stage and "optimizer" not in resolved:  # else the file's optimizer replaces the module's
        require_shardable_optimizer(fit_arguments.get("model"), f"ZeRO stage {stage}")
