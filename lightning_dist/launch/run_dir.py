"""`_target_: lightning_dist.launch.run_dir.OneRunPerDirectory`, as train.yaml said before lightning_dist/run/."""

from lightning_dist.run.run_dir import OneRunPerDirectory

__all__ = ["OneRunPerDirectory"]
