"""DeepSpeed's monitoring writes into the run's directory; a monitor whose package is missing is refused by key."""

from __future__ import annotations

from lightning_dist.strategies.deepspeed.config import outputs
from lightning_dist.strategies.deepspeed.config.outputs import anchor_output_paths, missing_monitor_packages


def test_relative_and_unset_output_paths_land_in_the_run_directory_and_absolute_ones_stay():
    config = {
        "csv_monitor": {"enabled": True, "output_path": "ds_logs/", "job_name": "a"},
        "tensorboard": {"enabled": True, "job_name": "b"},
        "flops_profiler": {"enabled": True, "output_file": "/abs/flops.txt"},
        "wandb": {"enabled": True, "project": "p"},
    }
    anchored = anchor_output_paths(config, "/runs/1")
    assert anchored["csv_monitor"]["output_path"] == "/runs/1/ds_logs/"
    assert anchored["tensorboard"]["output_path"] == "/runs/1/"
    assert anchored["flops_profiler"]["output_file"] == "/abs/flops.txt"
    assert anchored["wandb"] == {"enabled": True, "project": "p"}
    assert config["csv_monitor"]["output_path"] == "ds_logs/"  # the user's config is not modified
    disabled = {"csv_monitor": {"enabled": False, "output_path": "x/"}, "flops_profiler": {"enabled": True}}
    assert anchor_output_paths(disabled, "/runs/1") == disabled  # off, or no file: the profile prints to the log


def test_a_monitor_whose_package_is_missing_is_named_with_the_fix(monkeypatch):
    monkeypatch.setattr(outputs.importlib.util, "find_spec", lambda name: None)
    config = {"tensorboard": {"enabled": True}, "wandb": {"enabled": True}, "comet": {"enabled": False}, "csv_monitor": {"enabled": True}}
    assert missing_monitor_packages(config) == [
        "tensorboard.enabled=true: DeepSpeed's tensorboard monitor needs the tensorboard package; pip install tensorboard,"
        " or set tensorboard.enabled=false",
        "wandb.enabled=true: DeepSpeed's wandb monitor needs the wandb package; pip install wandb, or set wandb.enabled=false",
    ]
