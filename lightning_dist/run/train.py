"""Train and test a LightningModule with the strategy, model, data and trainer that `conf/` composes (compose.py):
the training run of the job that `python train.py` runs (job.py; the command line itself is cli.py).

    python train.py                                   # the embedded default: tiny GPT on pydoc text, DDP, 2 CPU ranks
    python train.py strategy=deepspeed_stage_3_offload
    python train.py strategy=fsdp trainer.max_steps=20 model=gpt_small
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.model_helpers import is_overridden
from omegaconf import DictConfig

from lightning_dist.lifecycle.collective_timeout import explain_collective_failure
from lightning_dist.lifecycle.exits import exit_code
from lightning_dist.lifecycle.peer_exits import say_leaving
from lightning_dist.lifecycle.process_exit import close_process_group
from lightning_dist.lifecycle.stop_signals import say_what_a_stop_keeps
from lightning_dist.run.compose import build, choices
from lightning_dist.run.config_check import ConfigError
from lightning_dist.run.resume import RESUME_ENV, what_a_stop_keeps
from lightning_dist.strategies.launcher import PreflightError, preflight

log = logging.getLogger(__name__)


# What Lightning's launcher (and its DeepSpeed strategy, for DeepSpeed's own set-up) puts into the environment for
# the ranks it starts. A later run in this interpreter (a notebook, a sequence of jobs) must pick its own port and
# world size, and a process it starts must not inherit a rank: Lightning reads RANK before SLURM_PROCID.
_LAUNCH_ENVIRONMENT = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "LOCAL_RANK", "RANK")


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit (unless train=false), then test (the best checkpoint); returns the final metrics. Runs on every rank
    (Lightning re-launches this script)."""
    saved = {name: os.environ.get(name) for name in _LAUNCH_ENVIRONMENT}
    try:
        return _fit_and_test(cfg)
    except BaseException as error:
        # Said before the process group closes (below): a rank that loses its connection to this one reads why.
        say_leaving(exit_code(error), error)
        raise
    finally:
        # Lightning leaves the process group up; the next job of a sweep in this process starts its own.
        close_process_group()
        os.environ.pop(RESUME_ENV, None)  # the next job of a sweep in this interpreter decides for itself
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _fit_and_test(cfg: DictConfig) -> dict[str, float]:
    L.seed_everything(cfg.seed, workers=True, verbose=False)  # our line before the bar names the seed
    parts = build(cfg, resuming=True)
    trainer: L.Trainer = parts["trainer"]
    try:
        # On this process, before any other rank starts and before anything is said about the run.
        preflight(trainer, model=parts["model"], datamodule=parts["datamodule"])
    except PreflightError as error:
        raise ConfigError(" ".join(str(error).split())) from error
    training = cfg.get("train", True)
    log.info(_describe(cfg, parts["model"], trainer, parts["strategy_name"]))
    # weights_only=None leaves the checkpoint to be vetted (safe_load.py); False is the user's opt-in.
    weights_only = False if cfg.get("trust_checkpoint") else None
    if training:
        _fit(trainer, parts, weights_only)
    metrics = _metrics(trainer)
    tested = None
    if cfg.get("test") and not is_overridden("test_step", parts["model"]):
        log.info("test=true, but %s has no test_step: no test run", type(parts["model"]).__name__)
    elif cfg.get("test"):
        ckpt_path, tested = _what_to_test(trainer) if training else _given_checkpoint(parts["ckpt_path"])
        if training and (averaging := _weights_averaged_by(trainer)):
            tested += f", as validated: the average {averaging} kept"
        log.info("Testing %s", tested)
        trainer.test(parts["model"], datamodule=parts["datamodule"], ckpt_path=ckpt_path, weights_only=weights_only)
        metrics.update(_metrics(trainer))
    if trainer.is_global_zero:
        _report(cfg, trainer, metrics, tested)
    return metrics


def _fit(trainer: L.Trainer, parts: dict[str, Any], weights_only: bool | None) -> None:
    say_what_a_stop_keeps(lambda: _kept(trainer))
    try:
        trainer.fit(parts["model"], datamodule=parts["datamodule"], ckpt_path=parts["ckpt_path"],
                    weights_only=weights_only)
    except RuntimeError as error:
        failure = explain_collective_failure(error, trainer)
        if failure is None:
            raise
        raise failure from error
    say_what_a_stop_keeps(None)  # kept where fit stopped: the stop line, said once the stop has unwound, reads it


def _given_checkpoint(checkpoint: Any) -> tuple[Any, str]:
    """train=false: the checkpoint `ckpt_path` (or `resume=true`) names, else the model as its config builds it (a
    pretrained model's own weights)."""
    if checkpoint is None:
        return None, "the model as built (train=false, no ckpt_path)"
    return checkpoint, f"the checkpoint {checkpoint}"


def _what_to_test(trainer: L.Trainer) -> tuple[str | None, str]:
    """The checkpoint to test (None: the model as it is) and the words for it: the best checkpoint, as
    lightning-hydra-template tests, loaded unless it holds the model's own weights (saved at the run's last step);
    the final weights where no best checkpoint was saved."""
    callback = trainer.checkpoint_callback
    best = callback.best_model_path if isinstance(callback, ModelCheckpoint) else ""
    if not best:
        return None, "the final weights (no best checkpoint was saved)"
    if getattr(callback, "best_model_step", None) == trainer.global_step:  # lightning_dist.callbacks.ModelCheckpoint
        return None, f"the final weights, the best checkpoint's ({best})"
    return best, f"the best checkpoint, {best}"


def _weights_averaged_by(trainer: L.Trainer) -> str | None:
    """After the fit, the name of the weight-averaging callback whose average was validated and saved as each
    checkpoint's weights, taken out of the Trainer: from a checkpoint loaded for the test it would restore the weights
    trained on instead (`current_model_state`), and the test would not measure what validation chose the best by."""
    from lightning_dist.strategies.weight_averaging import weight_averaging_callbacks

    averaging = weight_averaging_callbacks(trainer)
    callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
    callbacks[:] = [callback for callback in callbacks if callback not in averaging]
    return type(averaging[0]).__name__ if averaging else None


def _kept(trainer: L.Trainer) -> str | None:
    """What a stop of this run leaves to continue from (the stop line's words), where its checkpoints go."""
    callback = trainer.checkpoint_callback
    directory = getattr(callback, "dirpath", None)
    return what_a_stop_keeps(Path(directory)) if directory else None


def _describe(cfg: DictConfig, model: Any, trainer: L.Trainer, strategy_name: str) -> str:
    """One line for what ten "Instantiating ..." lines used to say: what trains, on what, and where it writes."""
    chosen = choices()
    parameters = sum(p.numel() for p in model.parameters())
    count = trainer.num_devices * trainer.num_nodes
    ranks = f"{count} {cfg.trainer.accelerator} rank{'s' if count > 1 else ''}"
    doing = "Training" if cfg.get("train", True) else "Testing"
    return (f"{doing} {chosen.get('model') or type(model).__name__} ({parameters / 1e6:.2f}M parameters) on "
            f"{chosen.get('data') or 'data'} with {strategy_name}, {ranks}, {cfg.trainer.precision}, seed {cfg.seed}; "
            f"outputs in {cfg.paths.output_dir}")


def _metrics(trainer: L.Trainer) -> dict[str, float]:
    # The training monitor's per-step readings are in the logs; the final metrics are the model's.
    return {name: float(value) for name, value in trainer.callback_metrics.items() if not name.startswith("monitor/")}


def _report(cfg: DictConfig, trainer: L.Trainer, metrics: dict[str, float], tested: str | None) -> None:
    print(f"\nOutputs: {cfg.paths.output_dir}")
    checkpoint = trainer.checkpoint_callback
    saved = checkpoint.last_model_path if isinstance(checkpoint, ModelCheckpoint) else ""
    last = Path(saved) if saved else None
    if last is not None and last.is_file():
        print(f"Last checkpoint: {last}")
    elif last is not None and last.is_dir():  # a sharded strategy's: a directory of shards
        print(f"Last checkpoint: {last} (shards; one file: lightning-dist consolidate {last}"
              " model.ckpt)")
    if tested:
        print(f"Tested {tested}")
    print("Final metrics: " + ", ".join(f"{name}={value:.4f}" for name, value in sorted(metrics.items())))
