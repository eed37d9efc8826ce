"""What a run is made of, composed once from the config: the data, the strategy (auto_fit's choice made), then the
model and the Trainer. A training run (`build`), a memory plan and a dry run (simulate.py) start from the same
`compose`; every configuration mistake becomes one ConfigError line naming its key."""

from __future__ import annotations

import inspect
import logging
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_dist.callbacks.monitored_metrics import MonitoredMetrics
from lightning_dist.checkpoints.contents import (
    check_autoep_layout,
    check_autotp_layout,
    check_checkpoint_matches,
    saved_weights_only,
    weights_only_refusal,
)
from lightning_dist.checkpoints.formats import CheckpointError, cannot_read
from lightning_dist.checkpoints.source import CheckpointSource
from lightning_dist.checkpoints.whole import check_whole
from lightning_dist.lifecycle.writable import unwritable_because
from lightning_dist.memory import AutoFit, ModelFacts
from lightning_dist.parallel import BlockClasses, require_classes_in_model, resolve_block_classes
from lightning_dist.parallel.precision import check_precision, device_type
from lightning_dist.parallel.sharded_init import parameters_on_meta
from lightning_dist.run.config_check import ConfigError
from lightning_dist.run.config_values import check_values
from lightning_dist.run.resume import checkpoint_to_resume

log = logging.getLogger(__name__)

# What the strategies run on: CPU processes (gloo) or CUDA GPUs (nccl); "gpu" and "auto" are Lightning's names for them.
ACCELERATORS = ("cpu", "cuda", "gpu", "auto")
# Placed under `model` by their config groups (lightning-hydra-template's layout); a module built without them uses
# its own choice.
FACTORY_GROUPS = ("optimizer", "scheduler")
# What a constructor raises for a value it refuses: said in one line under the key, like the checks before it.
CONFIG_MISTAKES = (InstantiationException, CheckpointError, MisconfigurationException, ValueError, TypeError)


@dataclass
class Composed:
    """The data and the strategy of a run, as the config composes them, and the strategy's name as the user chose it."""

    cfg: DictConfig
    datamodule: Any
    strategy: Any
    strategy_name: str
    _facts: ModelFacts | None = field(default=None, repr=False)
    _model: Any = field(default=None, repr=False)

    def facts(self) -> ModelFacts:
        """The model built on the meta device, its activations traced with one real training batch's shapes."""
        if self._facts is None:
            self.datamodule.setup("fit")
            batch = next(iter(self.datamodule.train_dataloader()))
            self._facts = ModelFacts.of(self.model_on_meta, batch, block_classes(self.cfg))
        return self._facts

    def model_on_meta(self) -> Any:
        """The run's LightningModule with its parameters on the meta device (no memory), built once."""
        if self._model is None:
            with torch.device("meta"):
                self._model = instantiate(module_config(self.cfg), _convert_="all")
        return self._model


def compose(cfg: DictConfig, choose: bool = True) -> Composed:
    """The checks before anything is built, then the data and the strategy; `choose`: auto_fit's choice made (from the
    model's facts), so that the strategy is the one that will run."""
    check_values(cfg)
    if str(cfg.trainer.accelerator) not in ACCELERATORS:
        raise ConfigError(f"trainer.accelerator={cfg.trainer.accelerator}: this package runs on CPU or CUDA; choose one"
                          f" of {', '.join(ACCELERATORS)}")
    datamodule = instantiate_node(cfg.data, "data")
    block_classes(cfg)  # the strategy reads it too: reported under the key the user set
    strategy = instantiate_node(cfg.strategy, "strategy")
    composed = Composed(cfg, datamodule, strategy, choices().get("strategy") or type(strategy).__name__)
    if choose and isinstance(strategy, AutoFit):
        devices, num_nodes = device_count(cfg)
        choice = strategy.choose(composed.facts(), cfg.trainer.precision, devices, num_nodes, cfg.trainer.accelerator)
        composed.strategy, composed.strategy_name = choice.strategy, choice.name  # the choice is logged with why
    return composed


def build(cfg: DictConfig, resuming: bool = False) -> dict[str, Any]:
    """Instantiate data, model, strategy, callbacks, loggers and trainer; configuration mistakes -> ConfigError.
    `resuming`: `resume=true` chooses `ckpt_path` once the model is built, passing over another model's saves."""
    try:
        composed = compose(cfg)
        strategy = composed.strategy
        check_precision(strategy, cfg.trainer.precision, device_type(cfg.trainer.accelerator))
        with _construction(strategy):
            model = instantiate_node(module_config(cfg), "model")
        if classes := block_classes(cfg):
            require_classes_in_model(model, classes, "model.block_class")
        shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}  # meta tensors have them
        if resuming:
            cfg.ckpt_path = checkpoint_to_resume(cfg, shapes, getattr(strategy, "autoep_size", None))
        checkpoint = _checked_checkpoint(cfg, shapes, strategy) if cfg.get("ckpt_path") else None
        # `callbacks.<name>=null` switches one off.
        configs = {name: c for name, c in (cfg.get("callbacks") or {}).items() if c is not None}
        callbacks = [instantiate_node(c, f"callbacks.{name}") for name, c in configs.items()]
        _check_checkpoint_dirs_writable(list(configs), callbacks)
        callbacks = _with_monitors_checked(list(configs), callbacks)
        loggers = [instantiate_node(c, f"logger.{name}") for name, c in (cfg.get("logger") or {}).items()
                   if c is not None]
        trainer = instantiate_node(cfg.trainer, "trainer", strategy=strategy, callbacks=callbacks, logger=loggers)
    except CONFIG_MISTAKES as error:
        raise config_error(error) from error
    return {"datamodule": composed.datamodule, "model": model, "trainer": trainer,
            "strategy_name": composed.strategy_name, "ckpt_path": checkpoint}


def _checked_checkpoint(cfg: DictConfig, shapes: dict[str, tuple[int, ...]], strategy: Any) -> CheckpointSource:
    """The checkpoint to start from, its format worked out once: whole, holding this model's weights, suiting the
    strategy and (unless trusted) vetted, here rather than on every rank after they started. The strategy loads it
    as it is (it is Lightning's `ckpt_path`)."""
    try:
        source = CheckpointSource.of(cfg.ckpt_path, trusted=cfg.get("trust_checkpoint", False))
        check_whole(source)
        if not check_autoep_layout(source, getattr(strategy, "autoep_size", None)):  # AutoEP's names are its own
            check_checkpoint_matches(source, shapes)
        check_autotp_layout(source, getattr(strategy, "checkpoint_tensor_parallel", None))
        if cfg.get("train", True) and saved_weights_only(source):  # Lightning would stop at its optimizer's restore
            raise CheckpointError(weights_only_refusal(cfg.ckpt_path, f"train=false ckpt_path={cfg.ckpt_path}"))
        return source.vet()
    except OSError as error:  # a file that vanished, or could not be read, after it was opened once
        raise CheckpointError(f"ckpt_path: {cfg.ckpt_path}: {cannot_read(error)}") from error


def _construction(strategy: Any) -> AbstractContextManager:
    """Where the strategy shards parameters, the model is built without weights (on the meta device) and every
    rank initialises only its own shards after launch: no process ever holds the whole model."""
    return parameters_on_meta() if getattr(strategy, "initializes_shards", False) else nullcontext()


def _check_checkpoint_dirs_writable(names: list[str], callbacks: list[Any]) -> None:
    """A checkpoint directory that cannot be written would fail at the first save, after every rank trained."""
    for name, callback in zip(names, callbacks):
        if isinstance(callback, ModelCheckpoint) and callback.dirpath and (why := unwritable_because(callback.dirpath)):
            raise ConfigError(f"callbacks.{name}.dirpath: cannot write checkpoints to {callback.dirpath} ({why})")


def _with_monitors_checked(names: list[str], callbacks: list[Any]) -> list[Any]:
    """The callbacks, led by the check that each metric one of them, or a scheduler, monitors is logged
    (monitored_metrics.py)."""
    monitoring = {f"callbacks.{name}.monitor": callback for name, callback in zip(names, callbacks)
                  if isinstance(getattr(callback, "monitor", None), str)}
    return [MonitoredMetrics(monitoring), *callbacks]


def config_error(error: Exception) -> ConfigError:
    # Hydra wraps what a constructor raised; the constructor's own message is the one that names the key.
    cause = error.__cause__ if isinstance(error, InstantiationException) and error.__cause__ else error
    return ConfigError(" ".join(str(cause).split()))


def module_config(cfg: DictConfig) -> DictConfig:
    """The model's config as its constructor takes it: without `block_class`, and without an optimizer or scheduler
    group the constructor does not accept (refused when the user chose one)."""
    module_cfg = cast(dict[str, Any], OmegaConf.to_container(cfg.model, resolve=True))
    module_cfg.pop("block_class", None)  # describes the model's structure; not a constructor argument
    unused = [group for group in FACTORY_GROUPS if group in module_cfg and not _takes(module_cfg["_target_"], group)]
    for group in unused:
        chosen = [o for o in _task_overrides() if o.split("=")[0].lstrip("+~") in (group, f"model.{group}")]
        if chosen:
            raise ConfigError(
                f"{chosen[0]}: {module_cfg['_target_']} takes no `{group}` argument, so it would be ignored; accept one"
                f" (lightning_dist.optim.ConfiguredOptimizers shows how) or leave {group} unset"
            )
        del module_cfg[group]
    return OmegaConf.create(module_cfg)


def _takes(target: str, argument: str) -> bool:
    try:
        parameters = inspect.signature(get_object(target)).parameters
    except (ImportError, ValueError, TypeError):
        return True  # let instantiation report it
    return argument in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def _task_overrides() -> list[str]:
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def choices() -> dict[str, Any]:
    """The config groups' options as chosen (`strategy=fsdp`: {"strategy": "fsdp", ...}); empty outside Hydra."""
    return dict(HydraConfig.get().runtime.choices) if HydraConfig.initialized() else {}


def block_classes(cfg: DictConfig) -> BlockClasses:
    return resolve_block_classes(cfg.model.block_class, "model.block_class") if cfg.model.get("block_class") else ()


def device_count(cfg: DictConfig) -> tuple[int, int]:
    """(devices per node, nodes), as numbers: what a plan and a dry run are sized by."""
    devices, num_nodes = cfg.trainer.devices, cfg.trainer.get("num_nodes", 1)
    if isinstance(devices, (list, ListConfig)):
        return len(devices), int(num_nodes)
    try:
        return int(devices), int(num_nodes)
    except ValueError:
        raise ConfigError(
            f"trainer.devices={devices}: planning memory needs a number of devices; set trainer.devices=N"
        ) from None


def instantiate_node(node: DictConfig, key: str, **runtime_objects: Any) -> Any:
    log.debug(f"Instantiating {key} <{node.get('_target_')}>")
    # _convert_=all: strategies receive plain dicts and lists (a DeepSpeed config must be a real dict).
    return instantiate(node, _convert_="all", **runtime_objects)
