"""DeepSpeed's own monitoring (tensorboard, csv_monitor, wandb, the flops profiler) writes into the run's directory.

DeepSpeed resolves relative paths against the working directory, so two runs from one checkout write into each other;
a run's outputs belong beside its checkpoints and logs.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

# Blocks whose output location DeepSpeed reads from the config: (block, key, is it a directory).
_OUTPUT_KEYS = (
    ("tensorboard", "output_path", True),
    ("csv_monitor", "output_path", True),
    ("flops_profiler", "output_file", False),
)
# Blocks that need a package DeepSpeed does not depend on.
MONITOR_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}


def enabled(config: dict[str, Any], block: str) -> bool:
    section = config.get(block)
    return isinstance(section, dict) and section.get("enabled") is True


def anchor_output_paths(config: dict[str, Any], run_dir: str | Path) -> dict[str, Any]:
    """A copy whose relative (or unset) monitor output directories lie under `run_dir`; absolute paths are kept, and
    the flops profiler without an `output_file` keeps printing to the log."""
    config = copy.deepcopy(config)
    for block, key, is_directory in _OUTPUT_KEYS:
        if not enabled(config, block):
            continue
        value = config[block].get(key)
        if value in (None, "") and is_directory:
            config[block][key] = str(Path(run_dir)) + "/"  # DeepSpeed joins it with job_name as a string
        elif value not in (None, "") and not Path(value).is_absolute():
            config[block][key] = str(Path(run_dir) / value) + ("/" if is_directory else "")
    return config


def missing_monitor_packages(config: dict[str, Any]) -> list[str]:
    """One `key: reason` problem per enabled monitor block whose package is not installed."""
    return [
        f"{block}.enabled=true: DeepSpeed's {block} monitor needs the {package} package; pip install {package},"
        f" or set {block}.enabled=false"
        for block, package in MONITOR_PACKAGES.items()
        if enabled(config, block) and importlib.util.find_spec(package) is None
    ]
