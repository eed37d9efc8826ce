"""Hydra internals. Checked on hydra-core 1.3.8."""

from __future__ import annotations

import argparse

from lightning_dist._compat import Fenced

FENCED = [Fenced("hydra._internal.utils", "get_args_parser")]


def hydra_args_parser() -> argparse.ArgumentParser:
    """Hydra's own command-line grammar (`--cfg`, `-m`, `--config-dir`, overrides), to read a command line the way
    `@hydra.main` will before handing it over. Hydra has no public accessor for it."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser()
