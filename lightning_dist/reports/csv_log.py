"""The CSV log of a run that may be continued into its own directory (`resume=true` with a fixed hydra.run.dir, as
a requeued SLURM job does): the continued attempt's rows follow the earlier ones in the same metrics.csv, where
Lightning's CSVLogger would delete the file as it starts."""

from __future__ import annotations

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger

from lightning_dist._compat.lightning import ContinuingCSVWriter, continuing_csv_writer


class ContinuingCSVLogger(CSVLogger):
    """Lightning's CSVLogger (same arguments, same files) that adds to an existing metrics.csv."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ContinuingCSVWriter:
        return continuing_csv_writer(self)
