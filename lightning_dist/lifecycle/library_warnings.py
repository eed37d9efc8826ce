"""Warnings the libraries we pin raise about their own code, and their adverts, silenced as soon as `lightning_dist`
is imported: a plain `L.Trainer` script is as quiet as `train.py`. Nothing a user of this package can act on; the
user's own warnings, and every other library warning, still show. Standard library only: `import lightning_dist`
stays light."""

from __future__ import annotations

import logging
import warnings

# (message, the module that raises it: the pinned library's own code)
LIBRARY_WARNINGS = (
    # torch 2.13 about Lightning 2.6.6's pytree helper
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", r"lightning|torch"),
    # torch 2.13 about the collectives DeepSpeed 0.19.8 calls, once per call site and rank (82 lines in 20 ZeRO-3 steps)
    (r"`torch\.distributed\.\w+` is deprecated", r"torch\.distributed"),
    # torch 2.13's memory tracker, when DDP's forward runs the module inside its own (a dry run of ddp)
    (r"The module hierarchy tracking maybe be messed up", r"torch\.distributed\._tools"),
    # transformers 5.25 about the property PEFT 0.21 reads as it wraps a model in adapters (once per rank)
    (r"`is_gradient_checkpointing` is deprecated", r"transformers"),
    # PEFT 0.21 about the rank and alpha it sets itself for a mixture of experts' fused gate_up_proj (LoRA on its
    # experts' parameters, all-linear): it checks them against module names only, and applies them to the parameter
    (r"The following (rank|alpha)_pattern keys did not match any targeted module and were ignored: "
     r"\['\.\*\\\\\.gate_up_proj'\]", r"peft"),
)

# Lines libraries log about their own set-up that no run here can act on: (logger, the line's start).
LIBRARY_LOG_LINES = (
    # bitsandbytes 0.50 on a CPU, as PEFT imports it: its 4-bit kernel from the Hub, which it then does without
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community"),
)


# Lines Lightning logs that advertise a product rather than describe the run (litlogger's "Tip", at every Trainer).
ADVERTS = ("💡 Tip:",)
ADVERTISING_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


def quiet_library_warnings() -> None:
    """Idempotent (`warnings` drops a filter it already has; a logger keeps one advert filter)."""
    for message, module in LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, module=module)
    for name in ADVERTISING_LOGGERS:
        _drop(name, ADVERTS)
    for name, start in LIBRARY_LOG_LINES:
        _drop(name, (start,))


def _drop(logger_name: str, starts: tuple[str, ...]) -> None:
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, _DropLines) and f.starts == starts for f in logger.filters):
        logger.addFilter(_DropLines(starts))


class _DropLines(logging.Filter):
    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)
