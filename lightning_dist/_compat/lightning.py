"""Lightning internals. Checked on lightning 2.6.6.

Lightning's launchers are private classes: subclassing them is the only way to change how ranks start (checks
before launch, ranks forked from a notebook's kernel). The functions below are the helpers its own strategies use
for the same jobs; ours reuse them instead of copying their logic.
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from unittest import mock

import torch
from lightning.fabric.connector import _convert_precision_to_unified_args
from lightning.fabric.strategies.deepspeed import _validate_device_index_selection
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.fabric.utilities.load import _load_distributed_checkpoint
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.loggers.csv_logs import ExperimentWriter as CSVExperimentWriter
from lightning.pytorch.strategies.deepspeed import remove_module_hooks
from lightning.pytorch.strategies.launchers.launcher import _Launcher as Launcher
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher as MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput as WorkerOutput
from lightning.pytorch.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as SubprocessScriptLauncher,
)
from lightning.pytorch.trainer.connectors.logger_connector import result as logged_results
from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.exceptions import _TunerExitException as TunerExit

from lightning_dist._compat.fenced import Fenced

if TYPE_CHECKING:
    # A mixin is checked as the Lightning strategy or module it will sit on; at run time it is a plain class, so the
    # mixins' order among themselves is the only order (tests/strategies/test_base_order.py).
    from lightning.pytorch import LightningModule as ModuleMixin
    from lightning.pytorch.strategies import DDPStrategy as StrategyMixin
else:
    ModuleMixin = StrategyMixin = object

__all__ = [
    "ModuleMixin",
    "StrategyMixin",
    "ContinuingCSVWriter",
    "Launcher",
    "checkpoint_contents",
    "MultiProcessingLauncher",
    "SubprocessScriptLauncher",
    "TunerExit",
    "WorkerOutput",
    "console_handler",
    "continuing_csv_writer",
    "end_job_as_its_failed_rank",
    "give_device_mesh",
    "lightning_grad_norm_runs",
    "is_stateful_loader",
    "load_distributed_checkpoint",
    "loader_with_sampler",
    "prepare_train_data_again",
    "reopen_epoch_stopped_early",
    "close_ended_epoch",
    "log_this_batch_now",
    "logs_this_step",
    "attached_trainer",
    "averaging_arguments",
    "average_model",
    "give_average_model",
    "save_last_now",
    "validation_follows",
    "move_optimizers_to_device",
    "module_optimizers",
    "read_bar_values_at_refresh",
    "step_in_progress",
    "broadcast_sigterm_at_logging_steps",
    "remove_module_hooks",
    "set_sampler_epoch",
    "set_threads_for_ranks",
    "train_data_source",
    "training_step_in_wrapper",
    "unified_precision",
    "validate_cuda_device_indices",
    "wrapped_by_strategy",
    "INHERITED_PRIVATES",
    "WRAPPED_MODULE_PREFIX",
    "strategy_timeout",
    "unwrapped_optimizer",
]

FENCED = [
    Fenced("lightning.pytorch.strategies.launchers.launcher", "_Launcher.launch", ("self", "function")),
    Fenced("lightning.pytorch.strategies.launchers.multiprocessing", "_MultiProcessingLauncher._wrapping_function"),
    Fenced(
        "lightning.pytorch.strategies.launchers.multiprocessing",
        "_MultiProcessingLauncher._collect_rank_zero_results",
        ("self", "trainer", "results"),
    ),
    Fenced("lightning.pytorch.strategies.launchers.multiprocessing", "_WorkerOutput"),
    Fenced("lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher"),
    # The thread that watches the ranks a launcher started; `_child_processes` and `_termination_signal` with it.
    Fenced(
        "lightning.fabric.strategies.launchers.subprocess_script", "_ChildProcessObserver._terminate_all", ("self",)
    ),
    Fenced("lightning.fabric.utilities.distributed", "_set_num_threads_if_needed", ("num_processes",)),
    Fenced("lightning.pytorch.strategies.ddp", "DDPStrategy._setup_model", ("self", "model")),
    Fenced("lightning.pytorch.strategies.ddp", "DDPStrategy._register_ddp_hooks", ("self",)),
    # The rich bar's epoch label (epoch_label_without_a_negative_total).
    Fenced("lightning.pytorch.callbacks.progress.rich_progress", "RichProgressBar._get_train_description",
           ("self", "current_epoch")),
    Fenced(
        "lightning.pytorch.trainer.connectors.checkpoint_connector",
        "_CheckpointConnector.dump_checkpoint",
        ("self", "weights_only"),
    ),
    Fenced(
        "lightning.pytorch.strategies.deepspeed",
        "DeepSpeedStrategy._setup_model_and_optimizer",
        ("self", "model", "optimizer"),
    ),
    Fenced(
        "lightning.pytorch.strategies.strategy",
        "_ForwardRedirection.__call__",
        ("self", "wrapper_module", "original_module", "method_name"),
    ),
    Fenced("lightning.fabric.utilities.optimizer", "_optimizers_to_device", ("optimizers", "device")),
    Fenced("lightning.fabric.strategies.deepspeed", "_validate_device_index_selection", ("parallel_devices",)),
    Fenced("lightning.fabric.connector", "_convert_precision_to_unified_args", ("precision",)),
    # Mirrored for AutoTP (strategies/deepspeed/autotp.py: initialize_inference_engine), which needs one more key.
    Fenced(
        "lightning.pytorch.strategies.deepspeed", "DeepSpeedStrategy._initialize_deepspeed_inference", ("self", "model")
    ),
    Fenced("lightning.pytorch.strategies.deepspeed", "remove_module_hooks", ("model",)),
    Fenced("lightning.fabric.utilities.load", "_load_distributed_checkpoint", ("checkpoint_folder",)),
    Fenced("lightning.pytorch.core.optimizer", "_configure_optimizers", ("optim_conf",)),
    Fenced("lightning", "_console"),
    Fenced("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop.reset", ("self",)),
    # What that reset asks of a train loader before it warns that a mid-epoch resume is unreliable.
    Fenced("lightning.fabric.utilities.types", "_Stateful"),
    # Re-runs a Hydra script for each other rank it starts, with `hydra.job.name=train_ddp_process_<local rank>`
    # (_compat/hydra.py reads it: without importing Lightning, for the command line).
    Fenced("lightning.fabric.strategies.launchers.subprocess_script", "_hydra_subprocess_cmd", ("local_rank",)),
    # The CSV writer deletes an existing metrics.csv as it starts; it keeps its columns in `metrics_keys`, sorted.
    Fenced("lightning.fabric.loggers.csv_logs", "_ExperimentWriter._check_log_dir_exists", ("self",)),
    Fenced("lightning.fabric.loggers.csv_logs", "_ExperimentWriter._record_new_keys", ("self",)),
    Fenced("lightning.fabric.loggers.csv_logs", "_ExperimentWriter._rewrite_with_new_header", ("self", "fieldnames")),
    # The progress bar's values, turned into Python numbers after every batch (read_bar_values_at_refresh).
    Fenced("lightning.pytorch.trainer.connectors.logger_connector.logger_connector", "_LoggerConnector.metrics"),
    Fenced("lightning.pytorch.trainer.connectors.logger_connector.logger_connector",
           "_LoggerConnector.progress_bar_metrics"),
    Fenced("lightning.pytorch.trainer.connectors.logger_connector.result", "convert_tensors_to_scalars", ("data",)),
    # What ModelCheckpoint asks before each save, and how it saves `last` (save_last_now).
    Fenced("lightning.pytorch.callbacks.model_checkpoint", "ModelCheckpoint._should_skip_saving_checkpoint",
           ("self", "trainer")),
    Fenced("lightning.pytorch.callbacks.model_checkpoint", "ModelCheckpoint._monitor_candidates", ("self", "trainer")),
    Fenced("lightning.pytorch.callbacks.model_checkpoint", "ModelCheckpoint._save_last_checkpoint",
           ("self", "trainer", "monitor_candidates")),
    # What the fit loop does right after `on_train_batch_end`: the batch's logged metrics to the loggers.
    Fenced("lightning.pytorch.trainer.connectors.logger_connector.logger_connector",
           "_LoggerConnector.update_train_step_metrics", ("self",)),
    # Whether the fit loop validates after the batch that just ended (validation_follows).
    Fenced("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop._should_check_val_fx",
           ("self", "data_fetcher")),
    # Every rank's SIGTERM flag, broadcast and read before every batch (broadcast_sigterm_at_logging_steps).
    Fenced("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop._broadcast_sigterm_tensor", ("self",)),
    # How Lightning gives a loader another sampler (its DistributedSampler), and sets each epoch's on its samplers.
    Fenced("lightning.pytorch.utilities.data", "_update_dataloader", ("dataloader", "sampler", "mode")),
    Fenced("lightning.fabric.utilities.data", "_set_sampler_epoch", ("dataloader", "epoch")),
    # The fit loop's train data, made once (`_combined_loader`, `_data_fetcher`): prepare_train_data_again.
    Fenced("lightning.pytorch.loops.fit_loop", "_FitLoop.setup_data", ("self",)),
    # How the Tuner's search fit ends on every rank, which then goes on with the user's script.
    Fenced("lightning.pytorch.utilities.exceptions", "_TunerExitException"),
    # What a WeightAveraging callback builds its AveragedModel from in `setup` (`_device`, `_use_buffers`, `_kwargs`),
    # and what it calls with it: strategies/torch/sharded_average.py builds the average in its place.
    Fenced("lightning.pytorch.callbacks.weight_averaging", "WeightAveraging.setup",
           ("self", "trainer", "pl_module", "stage")),
    Fenced("lightning.pytorch.callbacks.weight_averaging", "WeightAveraging._swap_models", ("self", "pl_module")),
    Fenced("lightning.pytorch.callbacks.weight_averaging", "WeightAveraging._copy_average_to_current",
           ("self", "pl_module")),
    # Public, but its code is swapped while our strategies run (lightning_grad_norm_runs).
    Fenced("lightning.pytorch.utilities.grads", "grad_norm", ("module", "norm_type", "group_separator")),
]

# Lightning's private hooks and attributes that our strategies (strategies/: the classes and their mixins) override,
# call or read as their own, by the Lightning strategy they extend. tests/test_compat_fence.py checks that each is
# still there, on the class or on an instance made with its defaults, and that every private name of Lightning's our
# strategies use is listed here: an upgrade that renames one fails that check, not a run.
INHERITED_PRIVATES: dict[str, tuple[str, ...]] = {
    "lightning.pytorch.strategies.ddp.DDPStrategy": (
        "_configure_launcher", "_get_process_group_backend", "_launcher", "_lightning_module", "_process_group_backend",
        "_setup_model", "_timeout",
    ),
    "lightning.pytorch.strategies.model_parallel.ModelParallelStrategy": (
        "_configure_launcher", "_device_mesh", "_get_process_group_backend", "_launcher", "_lightning_module",
        "_process_group_backend", "_save_distributed_checkpoint", "_setup_distributed", "_timeout",
    ),
    "lightning.pytorch.strategies.deepspeed.DeepSpeedStrategy": (
        "_config_initialized", "_configure_launcher", "_format_config", "_get_process_group_backend",
        "_init_config_if_needed", "_init_deepspeed_distributed", "_init_optimizers", "_initialize_deepspeed_inference",
        "_launcher", "_lightning_module", "_process_group_backend", "_timeout",
    ),
}

# Lightning's DeepSpeed strategy named the module's parameters inside its wrapper (`_forward_module`) up to Lightning
# 2.1, and its own conversion of a ZeRO checkpoint still strips the prefix (lightning.pytorch.utilities.deepspeed):
# checkpoints saved so are read without it.
WRAPPED_MODULE_PREFIX = "_forward_module."


def unwrapped_optimizer(optimizer: Any) -> Any:
    """The optimizer a LightningOptimizer wraps, or `optimizer` itself."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def strategy_timeout(strategy: Any) -> Any:
    """The timeout a Lightning strategy forms its process groups with (a timedelta), or None."""
    return getattr(strategy, "_timeout", None)


def checkpoint_contents(trainer: Any) -> dict[str, Any]:
    """What `trainer.save_checkpoint` would hand the strategy to write now: the module's and the optimizers' state,
    the loops', the callbacks'. Lightning's own saves build it so."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def wrapped_by_strategy(strategy: Any, module: Any) -> Any:
    """The wrapper `strategy.setup` puts around a LightningModule (DDP's), made the way setup makes it."""
    return strategy._setup_model(module)


def wrap_in_new_ddp(strategy: Any, module: Any) -> None:
    """`strategy.model`: a new DDP around `module`, made by Lightning's own DDP strategy's `_setup_model` (not an
    override of it) with its communication hooks, as its `configure_ddp` makes the first."""
    from lightning.pytorch.strategies import DDPStrategy

    strategy.model = DDPStrategy._setup_model(strategy, module)
    strategy._register_ddp_hooks()


def deepspeed_engine(strategy: Any, module: Any, optimizer: Any) -> tuple[Any, Any]:
    """(engine, its optimizer) for a LightningModule, made as the DeepSpeed strategy's `setup` makes them, from its
    resolved `config`."""
    return strategy._setup_model_and_optimizer(module, optimizer)


def training_step_in_wrapper(strategy: Any, wrapper: Any, module: Any, *args: Any) -> Any:
    """`module.training_step(*args)` as the strategy runs it: inside the wrapper's forward, so its hooks run."""
    return strategy._forward_redirection(wrapper, module, "training_step", *args)


def set_threads_for_ranks(num_processes: int) -> None:
    """Each of `num_processes` ranks on a node its share of the cores as intra-op threads, unless
    OMP_NUM_THREADS says otherwise: what Lightning's launcher does for its own rank only."""
    _set_num_threads_if_needed(num_processes=num_processes)


def move_optimizers_to_device(optimizers: list[torch.optim.Optimizer], device: torch.device) -> None:
    _optimizers_to_device(optimizers, device)


def validate_cuda_device_indices(devices: list[torch.device]) -> None:
    """DeepSpeed addresses a rank's GPU by its local rank: the devices must be 0..n-1 in order."""
    _validate_device_index_selection(devices)


def unified_precision(precision: Any) -> str:
    """`precision` as Lightning's Trainer normalises it ("16" -> "16-mixed", 32 -> "32-true", ...)."""
    return _convert_precision_to_unified_args(precision)


def load_distributed_checkpoint(path: Any) -> dict[str, Any]:
    """A torch.distributed.checkpoint directory read whole into this process's memory, without a process group.
    torch's public `dcp_to_torch_save` writes a second copy to disk to do the same."""
    return _load_distributed_checkpoint(path)


def module_optimizers(module: Any) -> list[torch.optim.Optimizer]:
    """The optimizers `module.configure_optimizers()` returns, read in whichever of Lightning's forms it uses."""
    from lightning.pytorch.core.optimizer import _configure_optimizers

    return _configure_optimizers(module.configure_optimizers())[0]


def give_device_mesh(module: Any, mesh: Any) -> None:
    """Make `mesh` what `module.device_mesh` returns in `configure_model`, as Lightning's ModelParallelStrategy does
    (the property has no setter)."""
    module._device_mesh = mesh


def train_data_source(trainer: Any) -> Any:
    """Where the fit loop gets its training data (a module's or datamodule's `train_dataloader`, or loaders given
    to `fit`): `.is_defined()`, `.dataloader()`. Lightning builds the loader only after `setup`."""
    return trainer.fit_loop._data_source


def step_in_progress(trainer: Any) -> int:
    """The optimizer step the fit loop is running, from before it fetches the step's batch until it begins the next:
    the count of steps it has finished (`trainer.global_step` moves on in the middle of the step)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def save_last_now(callback: Any, trainer: Any) -> bool:
    """A ModelCheckpoint's `last` saved now, as its own step cadence saves it, unless it would save nothing now
    (not fitting, a sanity check, fast_dev_run, or this step already saved); whether it saved."""
    if callback._should_skip_saving_checkpoint(trainer):
        return False
    callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))
    return True


def log_this_batch_now(trainer: Any) -> None:
    """In `on_train_batch_end` of a callback that ends the run there: what the fit loop would do next, this batch's
    logged metrics handed to the loggers (each saves its rows), so that the run's last row is not lost with it."""
    trainer._logger_connector.update_train_step_metrics()


def validation_follows(trainer: Any) -> bool:
    """In `on_train_batch_end`: whether the fit loop validates after this batch, as it decides next."""
    return trainer.fit_loop.epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher)


def attached_trainer(module: Any) -> Any:
    """The Trainer `module` is attached to, or None (Lightning's `module.trainer` raises where there is none)."""
    return getattr(module, "_trainer", None)


def averaging_arguments(callback: Any) -> tuple[Any, bool, dict[str, Any]]:
    """What a WeightAveraging callback builds its AveragedModel with, as its `setup` passes them: (its device or
    None, `use_buffers`, the rest: `avg_fn` or `multi_avg_fn`)."""
    return callback._device, callback._use_buffers, dict(callback._kwargs)


def average_model(callback: Any) -> Any:
    """The AveragedModel a WeightAveraging callback holds: made in its fit's `setup`, None before."""
    return callback._average_model


def give_average_model(callback: Any, average: Any) -> None:
    """Make `average` the AveragedModel a WeightAveraging callback updates, swaps in, copies and saves."""
    callback._average_model = average


def logs_this_step(trainer: Any) -> bool:
    """Whether the loggers write at this step (every `log_every_n_steps`, and at the last)."""
    return trainer._logger_connector.should_update_logs


class _BarValuesReadAtRefresh(_LoggerConnector):
    """Lightning's logger connector, except that the progress bar's values stay the tensors the module logged until
    the bar reads them (`progress_bar_metrics`, at its refresh). Lightning's turns them into Python numbers after
    every batch, whether or not the bar redraws: on a GPU, a wait for the device at every step."""

    @property
    def metrics(self) -> Any:
        with mock.patch.object(logged_results, "convert_tensors_to_scalars", lambda values: values):
            return super().metrics

    @property
    def progress_bar_metrics(self) -> Any:
        return logged_results.convert_tensors_to_scalars(super().progress_bar_metrics)


def read_bar_values_at_refresh(trainer: Any) -> None:
    """Make `trainer` read its progress bar's values on the host only when the bar asks for them. The bar shows what
    it showed before: the values as of its last refresh."""
    connector = trainer._logger_connector
    if type(connector) is _LoggerConnector:  # Lightning's own (a connector of the user's is left alone)
        connector.__class__ = _BarValuesReadAtRefresh


def epoch_label_without_a_negative_total(trainer: Any) -> None:
    """Lightning's rich bar (its default where `rich` is installed) labels an epoch "Epoch 0/<max_epochs - 1>": in a
    run bounded by `max_steps`, where Lightning sets `max_epochs` to -1, that read "Epoch 0/-2". There it says
    "Epoch 0"."""
    from lightning.pytorch.callbacks import RichProgressBar

    bar = trainer.progress_bar_callback
    if not isinstance(bar, RichProgressBar) or (trainer.max_epochs or 0) >= 0 or "_get_train_description" in vars(bar):
        return
    describe = bar._get_train_description
    total = f"/{trainer.max_epochs - 1}"
    bar._get_train_description = lambda epoch: describe(epoch).replace(total, "", 1)


def broadcast_sigterm_at_logging_steps(trainer: Any) -> None:
    """Make the ranks agree on a SIGTERM at the steps the loggers write rather than before every batch. Lightning's
    agreement is a broadcast read on the host: on a GPU, a wait for the device at every step. A job told to stop
    now stops within `log_every_n_steps` steps (at every step where that is 0)."""
    loop = trainer.fit_loop.epoch_loop
    if "_broadcast_sigterm_tensor" in vars(loop):  # done already, or replaced by someone else
        return
    broadcast = loop._broadcast_sigterm_tensor

    def at_logging_steps() -> None:
        if not trainer.log_every_n_steps or logs_this_step(trainer):
            broadcast()

    loop._broadcast_sigterm_tensor = at_logging_steps


def label_logged_rows_by_global_step(trainer: Any) -> None:
    """Make the step the loggers label this batch's row with the global step before it (as in a run never
    resumed). Lightning labels rows by a counter of its fit loop restored from the checkpoint, and adds the one step
    it lacks only for a save made mid-epoch (`_TrainingEpochLoop.reset`): after a checkpoint saved at the end of a
    run, every row was labelled a step early (steps 10-19 as 9-18). Only where the two count alike: automatic
    optimization of one optimizer."""
    if trainer.lightning_module.automatic_optimization and len(trainer.optimizers) == 1:
        trainer.fit_loop.epoch_loop._batches_that_stepped = trainer.global_step


def loader_with_sampler(dataloader: Any, sampler: Any) -> Any:
    """A train loader made again as Lightning makes one with its DistributedSampler, with `sampler` in its place."""
    return _update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING)


def prepare_train_data_again(trainer: Any) -> None:
    """The fit loop's train loaders made again, as it makes them when fit starts: asked for again, prepared for the
    loops' state, given their saved states. Lightning makes them once, whenever first asked."""
    fit_loop = trainer.fit_loop
    if fit_loop._data_fetcher is not None:
        fit_loop._data_fetcher.teardown()  # the earlier iterator's worker processes
    fit_loop._combined_loader = None
    fit_loop.setup_data()


def reopen_epoch_stopped_early(checkpoint: dict[str, Any]) -> tuple[int, int] | None:
    """A checkpoint saved as a run stopped in the middle of an epoch (`max_steps`, `max_time`, `trainer.should_stop`)
    holds that epoch as processed: Lightning ends the epoch it stopped in, epoch-end hooks and all, and a resume from
    a save in those hooks or after them starts the next epoch, never reading the rest of the stopped one. Its fit
    loop's state is made the one a save after that batch holds (the epoch started, not processed): the resume
    finishes the epoch. The epoch and the batches of it done where so; None for any other checkpoint."""
    fit_loop = (checkpoint.get("loops") or {}).get("fit_loop") or {}
    epochs, batches = fit_loop.get("epoch_progress"), fit_loop.get("epoch_loop.batch_progress")
    if not epochs or not batches or batches.get("is_last_batch", True) or batches["current"]["processed"] == 0:
        return None  # a real epoch end (its last batch was fetched), or no batch done in it
    if not all(p["ready"] == p["started"] == p["processed"] > 0 for p in epochs.values()):
        return None  # in the middle of the epoch already, as a save in it is
    for progress in epochs.values():  # `current` and `total`: saved in the epoch-end hooks, or after them
        progress["processed"] = progress["completed"] = progress["started"] - 1
    return epochs["current"]["started"] - 1, batches["current"]["processed"]


def close_ended_epoch(checkpoint: dict[str, Any]) -> int | None:
    """A checkpoint saved at an epoch's end, in the epoch-end hooks or after them (its last batch fetched, the epoch
    processed): resumed with `max_steps`, Lightning restarts that epoch at the batch after its last and, without a
    validation to stand in for it, trains one batch more there, steps an epoch schedule once more and numbers the next
    epoch one on (Lightning #19617). Its fit loop's state is made that of a save between that epoch and the next (the
    epoch completed, no batch of the next begun), which both `max_steps` and `max_epochs` resume alike. The epoch
    closed where so; None for any other checkpoint."""
    fit_loop = (checkpoint.get("loops") or {}).get("fit_loop") or {}
    epochs, batches = fit_loop.get("epoch_progress"), fit_loop.get("epoch_loop.batch_progress")
    if not epochs or not batches or not batches.get("is_last_batch") or batches["current"]["processed"] == 0:
        return None
    if not all(p["ready"] == p["started"] == p["processed"] > 0 for p in epochs.values()):
        return None  # saved before the epoch's end was processed (after its last batch): Lightning resumes it right
    for progress in epochs.values():
        progress["completed"] = progress["processed"]
    batches["current"] = dict.fromkeys(batches["current"], 0)
    batches["is_last_batch"] = False
    return epochs["current"]["completed"] - 1


def set_sampler_epoch(dataloader: Any, epoch: int) -> None:
    """What the fit loop does as an epoch starts: `set_epoch(epoch)` on the loader's sampler and batch sampler."""
    _set_sampler_epoch(dataloader, epoch)


def is_stateful_loader(loader: Any) -> bool:
    """Whether Lightning counts `loader` as resumable (it has `state_dict` and `load_state_dict`)."""
    from lightning.fabric.utilities.types import _Stateful

    return isinstance(loader, _Stateful)


def console_handler() -> logging.Handler:
    """The console handler `import lightning` gives the "lightning" logger."""
    import lightning

    return lightning._console


class ContinuingCSVWriter(CSVExperimentWriter):
    """Lightning's CSV writer, except that it keeps a metrics.csv it finds (Lightning's deletes it) and writes its rows
    after the earlier ones, under the union of their columns."""

    def _check_log_dir_exists(self) -> None:
        if not self._fs.isfile(self.metrics_file_path):  # fsspec: the log may live on a remote filesystem
            return
        with self._fs.open(self.metrics_file_path, "r", newline="") as file:
            columns = csv.DictReader(file).fieldnames or []
        # Lightning appends rows in the order of its sorted column list: a file in another order is rewritten first.
        self.metrics_keys = sorted(columns)
        if columns != self.metrics_keys:
            self._rewrite_with_new_header(self.metrics_keys)


def continuing_csv_writer(logger: Any) -> ContinuingCSVWriter:
    """The writer of Lightning's CSVLogger `logger`, made on first use as its `experiment` property makes its own."""
    if logger._experiment is None:
        logger._fs.makedirs(logger.root_dir, exist_ok=True)
        logger._experiment = ContinuingCSVWriter(log_dir=logger.log_dir)
    return logger._experiment


def end_job_as_its_failed_rank(end: Callable[[list], None]) -> None:
    """When a rank Lightning started fails, its child observer SIGKILLs the other ranks and this process too (rank
    0), so the job's exit code is 137, "killed", which reads as out of memory, whatever the rank reported. Instead
    `end` is called with the ranks' processes (local ranks 1, 2, ...: their return codes say which failed, and how),
    from the observer's thread; it must kill the others (one may be stuck in a collective that will never complete)
    and end this process."""

    def terminate_all(self: Any) -> None:
        end(list(self._child_processes))

    _ChildProcessObserver._terminate_all = terminate_all


def _runs_the_replacement(module: Any, norm_type: Any, group_separator: str = "/") -> dict[str, torch.Tensor]:
    # Runs as Lightning's `grad_norm`, in its module's globals: the replacement is kept on the function itself.
    from lightning.pytorch.utilities.grads import grad_norm

    return grad_norm.__dict__["replacement"](module, norm_type, group_separator)


def lightning_grad_norm_runs(replacement: Callable[..., dict[str, torch.Tensor]] | None) -> None:
    """Lightning's `grad_norm` runs `replacement` (called with its arguments) from now on, or its own code again
    (None). Its code is swapped, not its name: a user's module bound the function itself (`from
    lightning.pytorch.utilities import grad_norm`) when it was imported, before any strategy started. Stops in one
    line where Lightning's takes other arguments than the replacement is passed."""
    from lightning.pytorch.utilities import grads

    ours = _runs_the_replacement.__code__
    if replacement is None:
        grads.grad_norm.__code__ = _LIGHTNING_GRAD_NORM
        grads.grad_norm.__dict__.pop("replacement", None)
        return
    arguments = _LIGHTNING_GRAD_NORM.co_varnames[:_LIGHTNING_GRAD_NORM.co_argcount]
    if arguments != ours.co_varnames[:ours.co_argcount]:
        raise RuntimeError(f"lightning.pytorch.utilities.grad_norm{arguments} (lightning {_lightning_version()}): "
                           "lightning_dist/_compat/lightning.py passes (module, norm_type, group_separator) on")
    grads.grad_norm.__dict__["replacement"] = replacement
    grads.grad_norm.__code__ = ours


def _lightning_version() -> str:
    import lightning

    return lightning.__version__


def _lightning_grad_norm_code() -> Any:
    from lightning.pytorch.utilities import grads

    return grads.grad_norm.__code__


_LIGHTNING_GRAD_NORM = _lightning_grad_norm_code()  # Lightning's own, put back at each run's end
