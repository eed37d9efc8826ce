"""Hydra internals. Checked on hydra-core 1.3.8."""

from __future__ import annotations

import argparse

from lightning_dist._compat.fenced import Fenced

FENCED = [Fenced("hydra._internal.utils", "get_args_parser")]


def hydra_args_parser() -> argparse.ArgumentParser:
    """Hydra's own command-line grammar (`--cfg`, `-m`, `--config-dir`, overrides), to read a command line the way
    `@hydra.main` will before handing it over. Hydra has no public accessor for it."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser()


def is_a_rank_lightning_started(hydra_job_name: str) -> bool:
    """Whether this process is one of the ranks Lightning's launcher started for a Hydra script, by the job name it
    gives them. Lightning's observer of those ranks SIGKILLs the launching rank when one of them exits non-zero."""
    return hydra_job_name.startswith("train_ddp_process_")
