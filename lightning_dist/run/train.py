"""Train and test a LightningModule with the strategy, model, data and trainer that `conf/` composes: the job that
`python train.py` runs (the command line itself is `lightning_dist/run/cli.py`).

    python train.py                                   # the embedded default: tiny GPT on pydoc text, DDP, 2 CPU ranks
    python train.py strategy=deepspeed_stage_3_offload
    python train.py strategy=fsdp trainer.max_steps=20 model=gpt_small
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import sys
from datetime import timedelta
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import get_object, instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_dist._compat.fake_cuda import FakeCudaRunFailed
from lightning_dist._compat.hydra import is_a_rank_lightning_started
from lightning_dist.callbacks import NonFiniteError, Preempted
from lightning_dist.checkpoints.autoresume import (
    RESUME_OWN_DIR, finished_run, newest_complete_checkpoint, newest_whole_checkpoint_in,
)
from lightning_dist.checkpoints.contents import another_model, check_autotp_layout, check_checkpoint_matches
from lightning_dist.checkpoints.formats import CheckpointError
from lightning_dist.checkpoints.safe_load import vet_checkpoint
from lightning_dist.checkpoints.swap import SaveFailed
from lightning_dist.checkpoints.whole import check_whole
from lightning_dist.reports.console import is_rank_zero, quiet_console
from lightning_dist.run.config_check import ConfigError
from lightning_dist.run.config_values import check_values
from lightning_dist.run.isolated_job import JobFailed, needs_isolation, run_isolated
from lightning_dist.lifecycle.job_store import RefusedElsewhere, shared_choice
from lightning_dist.run.run_dir import discard_refused_run, discard_this_run_of_the_job
from lightning_dist.dry_run import RankView, can_dry_run, dry_run_configured, dry_run_devices
from lightning_dist.dry_run import table as dry_run_table
from lightning_dist.memory import AutoFit, Choice, MemoryPlan, ModelFacts, layout_of, plan_memory
from lightning_dist.memory.compare import compare_presets
from lightning_dist.parallel import BlockClasses, require_classes_in_model, resolve_block_classes
from lightning_dist.parallel.device_check import DeviceMismatch
from lightning_dist.lifecycle.exits import FINISHED, exit_code, exit_with, undo_on_refusal
from lightning_dist.lifecycle.collective_timeout import CollectiveFailure, explain_collective_failure
from lightning_dist.lifecycle.peer_exits import say_leaving
from lightning_dist.lifecycle.process_exit import close_process_group
from lightning_dist.parallel.sharded_init import parameters_on_meta
from lightning_dist.parallel.precision import check_precision, device_type
from lightning_dist.strategies.launcher import PreflightError, preflight
from lightning_dist.reports.summary_file import SUMMARY_NAME, read_summary
from lightning_dist.lifecycle.writable import unwritable_because

log = logging.getLogger(__name__)


def build(cfg: DictConfig, resuming: bool = False) -> dict[str, Any]:
    """Instantiate data, model, strategy, callbacks, loggers and trainer; configuration mistakes -> ConfigError.
    `resuming`: `resume=true` chooses `ckpt_path` once the model is built, passing over another model's saves."""
    try:
        check_values(cfg)
        _check_accelerator(cfg.trainer.accelerator)
        datamodule = _instantiate(cfg.data, "data")
        block_classes = _block_classes(cfg)  # the strategy reads it too: report it under the key the user set
        strategy = _instantiate(cfg.strategy, "strategy")
        strategy_name = _choices().get("strategy") or type(strategy).__name__
        if isinstance(strategy, AutoFit):
            choice = _auto_fit(cfg, strategy, _model_facts(cfg, datamodule))
            strategy, strategy_name = choice.strategy, choice.name
        check_precision(strategy, cfg.trainer.precision, device_type(cfg.trainer.accelerator))
        with _construction(strategy):
            model = _instantiate(_module_config(cfg), "model")
        if block_classes:
            require_classes_in_model(model, block_classes, "model.block_class")
        shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}  # meta tensors have them
        if resuming:
            cfg.ckpt_path = _checkpoint_to_resume(cfg, shapes)
        if cfg.get("ckpt_path"):
            check_whole(cfg.ckpt_path, trusted=cfg.get("trust_checkpoint", False))
            check_checkpoint_matches(cfg.ckpt_path, shapes, trusted=cfg.get("trust_checkpoint", False))
            check_autotp_layout(cfg.ckpt_path, getattr(strategy, "checkpoint_tensor_parallel", None))
            if not cfg.get("trust_checkpoint"):
                vet_checkpoint(cfg.ckpt_path)  # here, once, rather than on every rank after they started
        # `callbacks.<name>=null` switches one off.
        callbacks = [
            _instantiate(c, f"callbacks.{name}") for name, c in (cfg.get("callbacks") or {}).items() if c is not None
        ]
        _check_checkpoint_dirs_writable(cfg.get("callbacks") or {}, callbacks)
        loggers = [_instantiate(c, f"logger.{name}") for name, c in (cfg.get("logger") or {}).items() if c is not None]
        trainer = _instantiate(cfg.trainer, "trainer", strategy=strategy, callbacks=callbacks, logger=loggers)
    except (InstantiationException, CheckpointError, MisconfigurationException, ValueError, TypeError) as error:
        raise _config_error(error) from error
    return {"datamodule": datamodule, "model": model, "trainer": trainer, "strategy_name": strategy_name}


# What the strategies run on: CPU processes (gloo) or CUDA GPUs (nccl); "gpu" and "auto" are Lightning's names for them.
ACCELERATORS = ("cpu", "cuda", "gpu", "auto")


def _construction(strategy: Any) -> AbstractContextManager:
    """Where the strategy shards parameters, the model is built without weights (on the meta device) and every
    rank initialises only its own shards after launch: no process ever holds the whole model."""
    return parameters_on_meta() if getattr(strategy, "initializes_shards", False) else nullcontext()


def _check_accelerator(accelerator: Any) -> None:
    if str(accelerator) not in ACCELERATORS:
        raise ConfigError(
            f"trainer.accelerator={accelerator}: this package runs on CPU or CUDA; choose one of "
            f"{', '.join(ACCELERATORS)}"
        )


def _check_checkpoint_dirs_writable(configs: DictConfig, callbacks: list[Any]) -> None:
    """A checkpoint directory that cannot be written would fail at the first save, after every rank trained."""
    names = [name for name, c in configs.items() if c is not None]
    for name, callback in zip(names, callbacks):
        if isinstance(callback, ModelCheckpoint) and callback.dirpath and (why := unwritable_because(callback.dirpath)):
            raise ConfigError(f"callbacks.{name}.dirpath: cannot write checkpoints to {callback.dirpath} ({why})")


def _config_error(error: Exception) -> ConfigError:
    # Hydra wraps what a constructor raised; the constructor's own message is the one that names the key.
    cause = error.__cause__ if isinstance(error, InstantiationException) and error.__cause__ else error
    return ConfigError(" ".join(str(cause).split()))


# Placed under `model` by their config groups (lightning-hydra-template's layout); a module built without them uses
# its own choice.
FACTORY_GROUPS = ("optimizer", "scheduler")


def _module_config(cfg: DictConfig) -> DictConfig:
    module_cfg = OmegaConf.to_container(cfg.model, resolve=True)
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


def _choices() -> dict[str, Any]:
    return dict(HydraConfig.get().runtime.choices) if HydraConfig.initialized() else {}


def _block_classes(cfg: DictConfig) -> BlockClasses:
    return resolve_block_classes(cfg.model.block_class, "model.block_class") if cfg.model.get("block_class") else ()


def _model_facts(cfg: DictConfig, datamodule: Any) -> ModelFacts:
    """The model built on the meta device, its activations traced with one real training batch's shapes."""
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    return ModelFacts.of(lambda: instantiate(_module_config(cfg), _convert_="all"), batch, _block_classes(cfg))


def _device_count(cfg: DictConfig) -> tuple[int, int]:
    devices, num_nodes = cfg.trainer.devices, cfg.trainer.get("num_nodes", 1)
    if isinstance(devices, (list, ListConfig)):
        return len(devices), int(num_nodes)
    try:
        return int(devices), int(num_nodes)
    except ValueError:
        raise ConfigError(
            f"trainer.devices={devices}: planning memory needs a number of devices; set trainer.devices=N"
        ) from None


def _auto_fit(cfg: DictConfig, auto_fit: AutoFit, facts: ModelFacts) -> Choice:
    devices, num_nodes = _device_count(cfg)
    return auto_fit.choose(facts, cfg.trainer.precision, devices, num_nodes, cfg.trainer.accelerator)  # logs why


def plan(cfg: DictConfig) -> MemoryPlan:
    """`plan=true`: print the memory plan of this run and of every preset, and train nothing."""
    try:
        check_values(cfg)
        datamodule = _instantiate(cfg.data, "data")
        _block_classes(cfg)  # the strategy reads it too: reported under the key the user set
        strategy = _instantiate(cfg.strategy, "strategy")
        devices, num_nodes = _device_count(cfg)
        facts = _model_facts(cfg, datamodule)
        name = HydraConfig.get().runtime.choices.get("strategy") or type(strategy).__name__
        if isinstance(strategy, AutoFit):
            choice = _auto_fit(cfg, strategy, facts)
            strategy, name = choice.strategy, choice.name
        memory_plan = plan_memory(
            facts, layout_of(strategy, name), cfg.trainer.precision, devices=devices, num_nodes=num_nodes
        )
    except (InstantiationException, ValueError, TypeError) as error:
        raise _config_error(error) from error
    print(memory_plan.table())
    print()
    print(compare_presets(facts, cfg.trainer.precision, devices, num_nodes))
    return memory_plan


def dry_run(cfg: DictConfig) -> list[RankView]:
    """`dry_run=true`: the strategy's set-up and two steps at the configured world size, seen from the first and the
    last rank (or `dry_run_ranks`), under a fake process group and fake tensors; printed beside the plan."""
    try:
        check_values(cfg)
        datamodule = _instantiate(cfg.data, "data")
        _block_classes(cfg)
        strategy = _instantiate(cfg.strategy, "strategy")
        name = HydraConfig.get().runtime.choices.get("strategy") or type(strategy).__name__
        if not can_dry_run(strategy):
            raise ConfigError(f"dry_run=true: strategy={name} is not dry-run yet (every preset is; DeepSpeed's AutoTP,"
                              " strategy.tensor_parallel_size > 1, is not); plan=true gives its memory")
        devices, num_nodes = _device_count(cfg)
        world = devices * num_nodes
        ranks = tuple(cfg.get("dry_run_ranks") or (0, world - 1))
        if any(not 0 <= rank < world for rank in ranks):
            raise ConfigError(f"dry_run_ranks={list(ranks)}: global ranks of this run are 0 to {world - 1}")
        facts = _model_facts(cfg, datamodule)
        batch = next(iter(datamodule.train_dataloader()))
        ranks = tuple(dict.fromkeys(ranks))  # each once, in the order given
        memory_plan = plan_memory(facts, layout_of(strategy, name), cfg.trainer.precision, devices=devices,
                                  num_nodes=num_nodes)
        configs = (OmegaConf.to_container(cfg.strategy, resolve=True), OmegaConf.to_container(_module_config(cfg)))
    except (InstantiationException, ValueError, TypeError) as error:
        raise _config_error(error) from error
    device_type, run, where = dry_run_devices(cfg.trainer.accelerator, devices)
    try:
        views = run(dry_run_configured, *configs, batch, cfg.trainer.precision, devices, num_nodes, ranks, device_type)
    except (DeviceMismatch, FakeCudaRunFailed) as failure:
        if isinstance(failure, FakeCudaRunFailed) and not str(failure).startswith(DeviceMismatch.__name__):
            print(failure.child_traceback, file=sys.stderr)  # where it failed, in the process with CUDA faked
            raise
        raise ConfigError(f"dry_run=true found a device mismatch: {str(failure).removeprefix('DeviceMismatch: ')}")
    print(dry_run_table(views, name, cfg.trainer.precision, devices, num_nodes, memory_plan.device, where,
                        planned_host=memory_plan.host_total / devices,
                        device_memory_gb=cfg.get("dry_run_device_memory_gb", 80),
                        planned_nvme=sum(memory_plan.nvme.values()) / devices))
    return views


def _instantiate(node: DictConfig, key: str, **runtime_objects: Any) -> Any:
    log.debug(f"Instantiating {key} <{node.get('_target_')}>")
    # _convert_=all: strategies receive plain dicts and lists (a DeepSpeed config must be a real dict).
    return instantiate(node, _convert_="all", **runtime_objects)


# What Lightning's launcher (and its DeepSpeed strategy, for DeepSpeed's own set-up) puts into the environment for
# the ranks it starts. A later run in this interpreter (a notebook, a sequence of jobs) must pick its own port and
# world size, and a process it starts must not inherit a rank: Lightning reads RANK before SLURM_PROCID.
_LAUNCH_ENVIRONMENT = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "LOCAL_RANK", "RANK")


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit, then test; returns the final metrics. Runs on every rank (Lightning re-launches this script)."""
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
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _fit_and_test(cfg: DictConfig) -> dict[str, float]:
    L.seed_everything(cfg.seed, workers=True, verbose=is_rank_zero())
    parts = build(cfg, resuming=True)
    trainer: L.Trainer = parts["trainer"]
    try:
        # On this process, before any other rank starts and before anything is said about the run.
        preflight(trainer, model=parts["model"], datamodule=parts["datamodule"])
    except PreflightError as error:
        raise ConfigError(" ".join(str(error).split())) from error
    log.info(_describe(cfg, parts["model"], trainer, parts["strategy_name"]))
    try:
        # weights_only=None leaves the checkpoint to be vetted (safe_load.py); False is the user's opt-in.
        weights_only = False if cfg.get("trust_checkpoint") else None
        trainer.fit(parts["model"], datamodule=parts["datamodule"], ckpt_path=cfg.ckpt_path, weights_only=weights_only)
    except RuntimeError as error:
        failure = explain_collective_failure(error, trainer)
        if failure is None:
            raise
        raise failure from error
    finally:
        os.environ.pop(_RESUME_ENV, None)  # the next job of a sweep in this interpreter decides for itself
    metrics = _metrics(trainer)
    if cfg.get("test") and not is_overridden("test_step", parts["model"]):
        log.info("test=true, but %s has no test_step: no test run", type(parts["model"]).__name__)
    elif cfg.get("test"):
        trainer.test(parts["model"], datamodule=parts["datamodule"])
        metrics.update(_metrics(trainer))
    if trainer.is_global_zero:
        _report(cfg, trainer, metrics)
    return metrics


class NothingLeftToTrain(Exception):
    """`resume=true` found the last save of a run that trained to its end: this run trains nothing, says so, and
    leaves no run directory behind (`summary`: that run's)."""

    exit_code = FINISHED

    def __init__(self, said: str, summary: dict) -> None:
        super().__init__(said)
        self.summary = summary


# Rank 0 decides what to resume from; the ranks it starts inherit the decision through the environment, so a
# checkpoint written meanwhile cannot make them disagree.
_RESUME_ENV = "LIGHTNING_DIST_RESUME_FROM"


def _checkpoint_to_resume(cfg: DictConfig, shapes: dict[str, tuple[int, ...]]) -> str | None:
    """`resume=true`: the newest whole checkpoint of this command that holds this model's weights (`shapes`), each
    one passed over named with why; the user's own `ckpt_path` when given."""
    if cfg.get("ckpt_path") or not cfg.get("resume"):
        return cfg.get("ckpt_path")
    if _RESUME_ENV in os.environ:
        return os.environ[_RESUME_ENV] or None
    output_dir = Path(cfg.paths.output_dir)
    said = f"resume={'true' if cfg.resume is True else cfg.resume}: "
    passed: list[str] = []

    def passed_over(checkpoint: Path, why: str) -> None:
        passed.append(str(checkpoint))
        log.info(f"{said}passed over {checkpoint}: {why}")

    def another_models(checkpoint: Path) -> str | None:
        try:
            return another_model(checkpoint, shapes, "resume", trusted=cfg.get("trust_checkpoint", False))
        except CheckpointError as error:  # not a Lightning checkpoint at all
            return " ".join(str(error).removeprefix(f"resume: {checkpoint} ").split())

    def newest() -> str | None:
        if cfg.resume == RESUME_OWN_DIR:  # a requeued job: its own run directory only, never another job's
            found = newest_whole_checkpoint_in(output_dir, passed_over, another_models)
        else:
            # As typed: an override such as `+model.path=${paths.output_dir}/x` resolves to another path in every run.
            overrides = OmegaConf.to_container(HydraConfig.get().overrides.task, resolve=False)
            found = newest_complete_checkpoint(output_dir.parent, overrides, passed_over, another_models)
        return str(found) if found else None

    # Global rank 0's choice on every rank of a torchrun job (lifecycle/job_store.py), where each runs this search.
    found = shared_choice(newest, timedelta(seconds=cfg.strategy.get("timeout") or 1800))
    # Every rank asks (the run directories are on storage they share), so that every rank ends here together.
    if found is not None and cfg.resume is True and (finished := finished_run(Path(found))) is not None:
        raise NothingLeftToTrain(
            f"{said}nothing left to train: the newest whole checkpoint of this command, {found}, is the last save of a"
            f" run that trained to its end ({finished / SUMMARY_NAME}); pass ckpt_path={found} with a larger"
            " trainer.max_steps to train on from it, or resume=false to start afresh", read_summary(finished))
    if found is None:
        nothing = (f"no complete checkpoint in {output_dir}" if cfg.resume == RESUME_OWN_DIR
                   else "no earlier complete checkpoint of this command")
        log.info(
            said + nothing + (f" (passed over {len(passed)}, named above)" if passed else "") + "; starting afresh"
        )
    elif Path(found).parent.parent != output_dir:
        log.info(f"{said}resuming from {found}: an earlier run's, in {Path(found).parent.parent} ({output_dir} has no"
                 " checkpoint of its own)")
    else:
        log.info(f"{said}resuming from {found}")
    os.environ[_RESUME_ENV] = found or ""
    return found


def _describe(cfg: DictConfig, model: Any, trainer: L.Trainer, strategy_name: str) -> str:
    """One line for what ten "Instantiating ..." lines used to say: what trains, on what, and where it writes."""
    choices = _choices()
    parameters = sum(p.numel() for p in model.parameters())
    count = trainer.num_devices * trainer.num_nodes
    ranks = f"{count} {cfg.trainer.accelerator} rank{'s' if count > 1 else ''}"
    return (f"Training {choices.get('model') or type(model).__name__} ({parameters / 1e6:.2f}M parameters) on "
            f"{choices.get('data') or 'data'} with {strategy_name}, {ranks}, {cfg.trainer.precision}; outputs in "
            f"{cfg.paths.output_dir}")


def _metrics(trainer: L.Trainer) -> dict[str, float]:
    # The training monitor's per-step readings are in the logs; the final metrics are the model's.
    return {name: float(value) for name, value in trainer.callback_metrics.items() if not name.startswith("monitor/")}


def _report(cfg: DictConfig, trainer: L.Trainer, metrics: dict[str, float]) -> None:
    print(f"\nOutputs: {cfg.paths.output_dir}")
    checkpoint = trainer.checkpoint_callback
    if checkpoint is not None and checkpoint.last_model_path and Path(checkpoint.last_model_path).exists():
        print(f"Last checkpoint: {checkpoint.last_model_path}")
    print("Final metrics: " + ", ".join(f"{name}={value:.4f}" for name, value in sorted(metrics.items())))


def run_job(cfg: DictConfig) -> Any:
    """The job `python train.py` runs: a training run, a memory plan, or a sweep job in a process of its own.
    Returns the final metrics, or the one Hydra's optimizing sweepers minimise (`optimized_metric`)."""
    quiet_console()
    if cfg.trainer.accelerator == "cpu":  # said, so DeepSpeed need not detect it (and warn on every rank it did)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    hydra_config = HydraConfig.get()
    multirun = hydra_config.mode == RunMode.MULTIRUN
    undo_on_refusal(discard_this_run_of_the_job)  # another rank refused the run while its process group formed
    try:
        if needs_isolation(hydra_config, cfg.trainer):
            # A sweep job with ranks: run it as a single run in a process of its own
            # (lightning_dist/run/isolated_job.py).
            metrics = run_isolated(hydra_config)
        elif cfg.get("plan"):
            plan(cfg)
            _leave_nothing(hydra_config, multirun)
            return {}
        elif cfg.get("dry_run"):
            dry_run(cfg)
            _leave_nothing(hydra_config, multirun)
            return {}
        else:
            metrics = train(cfg)
    except (ConfigError, RefusedElsewhere, NonFiniteError, CollectiveFailure, JobFailed, SaveFailed) as error:
        if not multirun:
            if isinstance(error, (ConfigError, RefusedElsewhere)):
                discard_refused_run(Path(hydra_config.runtime.output_dir), hydra_config.job.name)
            if isinstance(error, NonFiniteError) and is_a_rank_lightning_started(hydra_config.job.name):
                # The ranks agree on a NaN stop (a collective), and rank 0 reports it with the job's exit code. A
                # non-zero exit here would have Lightning kill rank 0 first (exit 137, read as out of memory). Not
                # for errors a rank may meet alone: leaving quietly then would let the others wait in a collective.
                sys.exit(0)
            exit_with(error, code=exit_code(error))
        if cfg.get("optimized_metric") is None:
            raise  # Hydra reports the failed job and runs the others
        log.error(f"{error}: this trial counts as failed")
        return math.nan  # an optimizing sweeper records a failed trial and goes on
    except NothingLeftToTrain as done:  # exit 0: a requeued job of a finished run has nothing to do, and did it
        if not multirun:
            discard_refused_run(Path(hydra_config.runtime.output_dir), hydra_config.job.name)
        if is_rank_zero():
            log.info(str(done))
        return _objective(cfg, done.summary.get("metrics") or {})
    except Preempted as preempted:  # saved; the exit code (75) tells a scheduler or script to run it again
        if preempted.code:
            print(str(preempted), file=sys.stderr)
        sys.exit(preempted.code)
    return _objective(cfg, metrics)


def _leave_nothing(hydra_config: Any, multirun: bool) -> None:
    """A plan or a dry run trains nothing and leaves nothing (Hydra's `.hydra/`, the job's log, the run's claim):
    the run it was for can then go into the same directory."""
    if not multirun:  # a sweep's job directories are the sweep's record
        discard_refused_run(Path(hydra_config.runtime.output_dir), hydra_config.job.name)


def _objective(cfg: DictConfig, metrics: dict[str, float]) -> Any:
    name = cfg.get("optimized_metric")
    if name is None:
        return metrics
    if name not in metrics:
        raise ConfigError(
            f"optimized_metric={name}: the run reported no such metric; it reported {', '.join(sorted(metrics))}"
        )
    return metrics[name]
