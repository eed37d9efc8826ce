"""`_target_: lightning_dist.csv_log.ContinuingCSVLogger`, as logger/csv.yaml said before lightning_dist/reports/."""

from lightning_dist.reports.csv_log import ContinuingCSVLogger

__all__ = ["ContinuingCSVLogger"]
