"""Every option of every config group composes and builds what a run builds (`train.build`), and the lists Hydra
composes (`logger=[...]`, `callbacks=[...]`) are accepted and merge: an option whose `_target_` no longer
instantiates fails here, not in a user's run."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelSummary, RichProgressBar
from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger
from omegaconf import open_dict

from lightning_dist.callbacks import StepProgressBar
from lightning_dist.reports.csv_log import ContinuingCSVLogger
from lightning_dist.run.compose import build
from lightning_dist.run.config_check import check_overrides, group_options
from tests.conftest import CONF_DIR

GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra") + ["hydra/launcher"]
OPTIONS = [(group, option) for group in GROUPS for option in group_options(group)]
# Built on this CPU-only machine with the CPU accelerator: the rest of the gpu option (bf16, devices) still applies.
NO_GPU_HERE = ("trainer.accelerator=cpu", "trainer.devices=1") if not torch.cuda.is_available() else ()


# Groups the defaults list leaves out: added with `+`, as users type `+lora=default`, with what they apply to.
ADDED = {"lora": ("model=hf_gpt2",)}


def compose_run(tmp_path: Path, *overrides: str):
    """The config a run with `overrides` gets, with Hydra's own config set as in a run (output_dir: tmp_path)."""
    assert check_overrides(list(overrides)) is not None  # the pre-launch check accepts it
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=list(overrides), return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(tmp_path)
        cfg.hydra.job.name = "train"
    HydraConfig.instance().set_config(cfg)
    return cfg


def test_every_group_has_options():
    assert {group for group, _ in OPTIONS} == set(GROUPS)
    assert {"optimizer", "scheduler", "logger", "callbacks", "debug", "hparams_search"} <= set(GROUPS)


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_builds_a_run(group, option, tmp_path):
    # fsdp_tp_pp's 2 stages x 2 tensor-parallel ranks need 4 (2, the default, is refused in one line).
    extra = {("trainer", "gpu"): NO_GPU_HERE, ("strategy", "fsdp_tp_pp"): ("trainer.devices=4",)}.get((group, option), ())
    override = f"+{group}={option}" if group in ADDED else f"{group}={option}"
    cfg = compose_run(tmp_path, override, *extra, *ADDED.get(group, ()))
    parts = build(cfg)
    assert isinstance(parts["trainer"], L.Trainer) and isinstance(parts["model"], L.LightningModule)
    if group == "lora":  # PEFT's adapters on the model, only they trainable
        trainable = [name for name, param in parts["model"].named_parameters() if param.requires_grad]
        assert trainable and all("lora_" in name for name in trainable), trainable
    optimizers = parts["model"].configure_optimizers()  # the optimizer and scheduler groups' partials, called
    optimizer = optimizers["optimizer"] if isinstance(optimizers, dict) else optimizers
    assert isinstance(optimizer, torch.optim.Optimizer)
    if group == "optimizer":
        assert type(optimizer).__name__.lower() == option
    if group == "scheduler":
        assert type(optimizers["lr_scheduler"]["scheduler"]).__name__ == ("ReduceLROnPlateau" if option == "plateau" else "LambdaLR")
    if group == "hparams_search":
        sweeper = instantiate(cfg.hydra.sweeper)
        assert type(sweeper).__name__ == "OptunaSweeper" and cfg.optimized_metric == "val_loss"
    if group == "hydra/launcher":
        assert type(instantiate(cfg.hydra.launcher)).__name__ == {"local": "LocalLauncher", "slurm": "SlurmLauncher"}[option]


def test_logger_list_builds_every_logger(tmp_path):
    parts = build(compose_run(tmp_path, "logger=[csv,tensorboard,wandb,mlflow]"))
    assert [type(logger) for logger in parts["trainer"].loggers] == [ContinuingCSVLogger, TensorBoardLogger, WandbLogger, MLFlowLogger]
    assert [type(logger) for logger in build(compose_run(tmp_path, "logger=many_loggers"))["trainer"].loggers] == [
        ContinuingCSVLogger, TensorBoardLogger, WandbLogger, MLFlowLogger]


def test_callback_list_adds_options_and_the_rich_bar_replaces_the_default_one(tmp_path):
    cfg = compose_run(tmp_path, "callbacks=[default,early_stopping,model_summary,rich_progress_bar,lr_monitor]")
    callbacks = build(cfg)["trainer"].callbacks
    kinds = {type(c) for c in callbacks}
    assert {EarlyStopping, ModelSummary, RichProgressBar, LearningRateMonitor} <= kinds
    assert StepProgressBar not in kinds and sum(isinstance(c, RichProgressBar) for c in callbacks) == 1
    assert StepProgressBar in {type(c) for c in build(compose_run(tmp_path))["trainer"].callbacks}


def test_callbacks_none_leaves_lightnings_own():
    cfg = check_overrides(["callbacks=none"])
    assert not cfg.get("callbacks")


def test_an_option_that_needs_a_missing_package_names_it_and_the_install(monkeypatch):
    from lightning_dist.run import config_check
    from lightning_dist.run.config_check import ConfigError

    monkeypatch.setattr(config_check, "_installed", lambda module: module != "wandb")
    with pytest.raises(ConfigError, match=r'^logger=wandb: needs wandb, not installed here; pip install -e "\.\[loggers\]"$'):
        check_overrides(["logger=[csv,wandb]"])
