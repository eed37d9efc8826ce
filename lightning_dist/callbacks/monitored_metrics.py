"""Every metric a callback monitors is one the model logs, said in one line naming the config key.

Lightning finds out only at the first validation after training steps: ModelCheckpoint raises its
MisconfigurationException there (a traceback, after a validation interval of training, with no save of it), and
EarlyStopping its RuntimeError. lightning-hydra-template's configs monitor `val/loss`, where many modules log
`val_loss`; a plateau scheduler that watches a name never logged never steps. Here:

- at the sanity check's end, where the validation's names are known, a monitored name the validation did not log
  stops the run before its first training step, when the name is a validation's (it starts with `val`, or it
  differs from a logged name only in case and separators). Any other name may be a training metric, not logged yet;
- at each validation, before the callbacks that monitor it read it, a name still not logged stops the run, with
  `last` saved first: what trained is kept, to continue from (`ckpt_path`) once the key is fixed. (Not `resume=true`:
  the fixed command is another command, and resume searches the runs of the same one.)
"""

from __future__ import annotations

import difflib
import re

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_dist._compat.lightning import save_last_now

# What Lightning's ModelCheckpoint may monitor besides the logged metrics (its `_monitor_candidates`).
_ALWAYS_THERE = ("epoch", "step")


class MetricNotLogged(ValueError):
    """A callback monitors a metric the model does not log (exit code 2: the configuration's mistake)."""

    exit_code = 2


class MonitoredMetrics(L.Callback):
    """Checks the `monitor` of `callbacks`, each under its config key ({"callbacks.model_checkpoint.monitor":
    callback}), and of the learning-rate schedulers. Put it before the callbacks in the Trainer's: the check must come
    before they read the metric."""

    def __init__(self, callbacks: dict[str, L.Callback]) -> None:
        self.callbacks = callbacks

    @override
    def on_sanity_check_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        logged = _logged(trainer)
        for key, name, _ in self._monitored(trainer):
            if name not in logged and _names_validation(name, logged):
                raise MetricNotLogged(f"{key}={name}: the model's validation logs no metric of that name; it logs "
                                      f"{_listed(logged)}{_suggestion(name, logged)}")

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:  # trainer.validate() saves nothing
            return
        logged = _logged(trainer)
        missing = [(key, name) for key, name, anytime in self._monitored(trainer)
                   if name not in logged and (anytime or _names_validation(name, logged))]
        if not missing:
            return
        key, name = missing[0]
        kept = self._save_last(trainer)
        raise MetricNotLogged(f"{key}={name}: the model has logged no metric of that name by the validation at step "
                              f"{trainer.global_step}; it logs {_listed(logged)}{_suggestion(name, logged)}{kept}")

    def _monitored(self, trainer: L.Trainer) -> list[tuple[str, str, bool]]:
        """(config key, name, whether any name must be logged by the first validation) of each monitor: the
        callbacks' (Lightning's EarlyStopping with `strict=False` only warns, and so is left to), and a scheduler's.
        A plateau scheduler's `strict` is no exception: before the first validation it must skip its steps
        (optim/configured.py), after one it would never step again, without a word. But a scheduler stepped at the
        epoch's end may watch a training metric logged only there, after a validation within the epoch: of its
        names, only a validation's must be logged by then."""
        monitors = [(key, getattr(callback, "monitor", None), callback) for key, callback in self.callbacks.items()]
        callbacks = [(key, name, True) for key, name, callback in monitors
                     if isinstance(name, str) and getattr(callback, "strict", True)]
        schedulers = [(f"{type(config.scheduler).__name__}'s monitor", config.monitor, False)
                      for config in trainer.lr_scheduler_configs if config.monitor]
        return callbacks + schedulers

    def _save_last(self, trainer: L.Trainer) -> str:
        """`last` saved by each checkpoint callback that keeps one; the words that say where, or nothing."""
        keeping = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.save_last]
        for callback in keeping:
            save_last_now(callback, trainer)  # nothing, where this step's `last` is saved already
        saved = [callback.last_model_path for callback in keeping if callback.last_model_path]
        if not saved:
            return ""
        return f"; saved {saved[0]}: fix the key and pass ckpt_path={saved[0]} to continue from it"


def _logged(trainer: L.Trainer) -> list[str]:
    return [*trainer.callback_metrics, *_ALWAYS_THERE]


def _listed(logged: list[str]) -> str:
    # The training monitor's own readings (monitor/...) are many and rarely what a checkpoint means.
    return ", ".join(sorted(name for name in logged if not name.startswith("monitor/") and name not in _ALWAYS_THERE))


def _names_validation(name: str, logged: list[str]) -> bool:
    return name.lower().startswith("val") or _normal(name) in {_normal(other) for other in logged}


def _normal(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower())


def _suggestion(name: str, logged: list[str]) -> str:
    normal = {_normal(other): other for other in logged}
    close = normal.get(_normal(name)) or next(iter(difflib.get_close_matches(name, logged, n=1)), None)
    return f" (did you mean {close}?)" if close else ""
