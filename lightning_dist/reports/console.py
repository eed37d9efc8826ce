"""What `python train.py` prints: each line a person needs, once, before the progress bar.

Lightning starts the other ranks by running the script again, so without this every rank repeats the run's set-up
log; and Lightning prints, line by line, what our one line before the bar says. What nobody can act on (a deprecation
inside Lightning itself, an advert) is quieted for plain scripts too, by `import lightning_dist`
(lifecycle/library_warnings.py)."""

from __future__ import annotations

import logging

from lightning.fabric.utilities.rank_zero import rank_zero_only

from lightning_dist.lifecycle.library_warnings import quiet_library_warnings

# What Lightning logs that our own line says already (the devices, the ranks, the seed) or the bar shows (the step
# the run stopped at: printed onto the finished bar, which was then drawn again).
# Each rank's "Initializing distributed" line stays: on several nodes it is the one line that says who joined.
REPEATED = ("GPU available:", "TPU available:", "HPU available:", "-" * 100 + "\ndistributed_backend=",
            "`Trainer.fit` stopped:")
LIGHTNING_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
# Loggers whose INFO lines describe the whole run: printed by rank 0 alone.
RUN_LOGGERS = ("lightning_dist", "lightning.pytorch", "lightning.fabric")
# Loggers whose INFO lines are another tool's internals: the compiler commands DeepSpeed's op builders try.
TOOL_LOGGERS = ("compilers",)


def quiet_console() -> None:
    """Idempotent; warnings and errors still reach the console from every rank."""
    quiet_library_warnings()
    for name in LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropRepeated) for f in logger.filters):
            logger.addFilter(_DropRepeated())
    for name in TOOL_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    _one_handler_per_line()
    if not is_rank_zero():
        for name in RUN_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)


def _one_handler_per_line() -> None:
    # `import lightning` gives the "lightning" logger a console handler of its own; Lightning's subpackages stop
    # their records there only when the root logger had no handler at import. Once Hydra has configured logging
    # first (our CLI imports Lightning inside the job), every line would print twice: Hydra's handlers serve alone.
    from lightning_dist._compat.lightning import console_handler

    if logging.getLogger().hasHandlers():
        logging.getLogger("lightning").removeHandler(console_handler())


def is_rank_zero() -> bool:
    return getattr(rank_zero_only, "rank", 0) == 0  # Lightning sets the rank on the function


class _DropRepeated(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(REPEATED)
