"""`metrics.json`: what a run did (a finished one in full; one stopped early, its curves), written by rank 0 for
people and scripts to read."""

from __future__ import annotations

import json
import resource
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from lightning_dist._compat.lightning import logs_this_step
from lightning_dist.memory.measure import model_state_bytes
from lightning_dist.parallel.devices import gather_numbers, gather_objects
from lightning_dist.parallel.dims import parallel_dims_of
from lightning_dist.parallel.placement import placement_report
from lightning_dist.reports.flops import Utilisation


class RunSummary(L.Callback):
    """Records the strategy, world size, nodes (and each rank's node and host), steps, batches trained on each rank,
    where each rank's parameters and optimizer state were at the first logged step (evidence of sharding and
    offload), the model state each rank held at the first logged step from the third on (`memory/measure.py`: what
    the memory planner is checked against), speed (median step time, samples and tokens per second over all ranks,
    and model FLOPs utilisation when the training monitor knows the model's FLOPs and the device's peak), peak memory
    per rank, the final metrics, and the curves of `curves` (per logging step and per validation, step labels as the
    loggers write them), whichever loggers are on: the sweep report and the equivalence check read them from here."""

    def __init__(self, path: str | Path, curves: tuple[str, ...] = ("train_loss", "val_loss")) -> None:
        self.path = Path(path)
        self.curve_names = tuple(curves)
        # Kept as the device tensors the module logged until the run ends: a float per step would wait for the device.
        self.curves: dict[str, dict[int, torch.Tensor | float]] = {name: {} for name in self.curve_names}
        self._recorded_step = -1
        self.batches_on_this_rank = 0
        self.optimizer_steps = 0
        self.step_times: list[float] = []
        self.batch_shape: tuple[int, ...] = ()
        self._step_start = 0.0
        self.summary: dict = {}

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        self._step_start = time.perf_counter()
        self.batch_shape = input_shape(batch)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        self.step_times.append(time.perf_counter() - self._step_start)
        self.batches_on_this_rank += 1
        stepped = trainer.global_step != self._recorded_step  # the last micro-batch of an accumulated step
        every = trainer.log_every_n_steps  # type: ignore[attr-defined]  # set by Lightning's logger connector
        logging_step = every and trainer.global_step % every == 0
        if stepped and (logging_step or trainer.should_stop):  # the loggers' cadence, and the last step
            self._record(trainer, trainer.global_step - 1, validation=False)
        self._recorded_step = trainer.global_step
        if "placement_per_rank" not in self.summary and logging_step:
            self._record_placement(trainer, pl_module)

    def _record_placement(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A gather, read on the host: at a step the loggers write (or at the end), where the host waits anyway.
        report = placement_report(pl_module, trainer.optimizers)
        # Ours read it back from their engine; Lightning's own strategies are not asked.
        offload_targets = getattr(trainer.strategy, "offload_targets", None)
        report["offload"] = offload_targets() if offload_targets else {"optimizer": None, "parameters": None}
        self.summary["placement_per_rank"] = gather_objects(report)

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        # Gradients and optimizer state are both alive from the second step on; by the third, ZeRO-3 has recorded
        # its trace (after the sanity check's eval trace is dropped) and keeps its small parameters whole. Measured
        # at the first step from there that the loggers write, or at the last (a gather is a wait on the host).
        self.optimizer_steps += 1
        due = logs_this_step(trainer) or 0 < trainer.max_steps <= trainer.global_step + 1  # a logged step, or the last
        if self.optimizer_steps >= 3 and "model_state_bytes_per_rank" not in self.summary and due:
            self.summary["model_state_bytes_per_rank"] = gather_objects(
                model_state_bytes(pl_module, trainer.optimizers)
            )

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Labelled as the loggers label it: the optimizer steps before the last one; the sanity check is step 0.
        self._record(trainer, 0 if trainer.sanity_checking else max(0, trainer.global_step - 1), validation=True)

    def _record(self, trainer: L.Trainer, step: int, validation: bool) -> None:
        for name in self.curve_names:
            value = trainer.callback_metrics.get(name)
            if value is not None and name.startswith("val") == validation:
                self.curves[name][step] = value.detach().clone() if isinstance(value, torch.Tensor) else float(value)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        finish_checkpoints = getattr(trainer.strategy, "finish_checkpoints", None)
        if finish_checkpoints is not None:  # background saves: one that failed ends the run here, on every rank
            finish_checkpoints()
        if "placement_per_rank" not in self.summary:  # no step was logged
            self._record_placement(trainer, pl_module)
        # Every rank must take part in the gather, so this runs before the rank-0-only write.
        mine = [self.batches_on_this_rank, torch.get_num_threads(), trainer.node_rank]
        per_rank = gather_numbers(mine, trainer.strategy.root_device, dtype=torch.int64)
        self.summary.update(
            strategy=type(trainer.strategy).__name__,
            process_group_backend=_process_group_backend(),
            world_size=trainer.world_size,
            num_nodes=trainer.num_nodes,
            node_rank_per_rank=[node for _, _, node in per_rank],
            host_per_rank=gather_objects(socket.gethostname()),
            global_step=trainer.global_step,
            train_batches_per_rank=[batches for batches, _, _ in per_rank],
            intra_op_threads_per_rank=[threads for _, threads, _ in per_rank],
            best_checkpoint=_checkpoint_path(trainer, "best_model_path"),
            last_checkpoint=_checkpoint_path(trainer, "last_model_path"),
            data_parallel_size=parallel_dims_of(trainer.strategy).dp_size,
            # Each rank's place on every parallel axis (pp, dp_replicate, dp_shard, cp, tp), as the rank has it.
            parallel_sizes=parallel_dims_of(trainer.strategy).sizes,
            coordinates_per_rank=gather_objects(parallel_dims_of(trainer.strategy).coordinates(trainer.global_rank)),
            **self._speed(parallel_dims_of(trainer.strategy).dp_size, trainer),
            peak_memory_per_rank=gather_objects(peak_memory(trainer.strategy.root_device)),
            curves=self._curves_on_host(),
        )
        self._update_metrics(trainer)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # A run stopped early (preempted, failed) keeps the curves it logged; without `global_step` it reads as
        # unfinished. No gathers: the other ranks may be gone or stuck.
        self.summary.update(stopped_by=type(exception).__name__, curves=self._curves_on_host())
        if trainer.is_global_zero:
            self._write()

    def _curves_on_host(self) -> dict[str, dict[int, float]]:
        return {name: {step: float(value) for step, value in points.items()} for name, points in self.curves.items()}

    def _speed(self, data_parallel_size: int, trainer: L.Trainer) -> dict:
        # The first step compiles, allocates and warms caches; it is not what a long run spends per step.
        times = self.step_times[1:] or self.step_times
        if not times:
            return {}
        step = statistics.median(times)
        speed: dict[str, Any] = {"median_step_time_s": step}
        speed.update(throughput(self.batch_shape or (1,), data_parallel_size, step))
        # The training monitor's terms (it counts the model before the strategy splits it, and knows the peak).
        callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
        monitors = (getattr(callback, "utilisation", None) for callback in callbacks)
        utilisation = next((u for u in monitors if isinstance(u, Utilisation)), None)
        if utilisation is not None and "tokens_per_s" in speed:
            utilisation = utilisation.raised_to(speed["tokens_per_s"], trainer.world_size)
            speed.update(
                mfu=utilisation.mfu(speed["tokens_per_s"], trainer.world_size),
                model_flops_per_token=utilisation.flops_per_token,
                peak_flops_per_device=utilisation.peak_flops_per_device,
                peak_flops_source=utilisation.peak_source,
            )
        return speed

    @override
    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._update_metrics(trainer)

    def _update_metrics(self, trainer: L.Trainer) -> None:
        # Fit and test each leave their own metrics behind; the summary keeps both.
        self.summary.setdefault("metrics", {}).update(
            {name: float(value) for name, value in trainer.callback_metrics.items()}
        )
        if trainer.is_global_zero:
            self._write()

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.summary, indent=2) + "\n")


def input_shape(batch: Any) -> tuple[int, ...]:
    """The shape of a batch's inputs (the first element of a tuple or list batch); () when not a tensor."""
    inputs = batch[0] if isinstance(batch, (list, tuple)) else batch
    return tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else ()


def throughput(shape: tuple[int, ...], data_parallel_size: int, step_time: float) -> dict[str, float]:
    """Samples per second over all ranks, and tokens per second when the inputs are (batch, sequence) token ids.
    Each data-parallel rank has its own batch of `shape`; the ranks of a tensor-parallel group share one."""
    speed = {"samples_per_s": shape[0] * data_parallel_size / step_time}
    if len(shape) == 2:
        speed["tokens_per_s"] = shape[0] * shape[1] * data_parallel_size / step_time
    return speed


def peak_memory(device: torch.device) -> dict:
    """The most memory this rank held: allocated CUDA memory on a GPU, the process's peak resident set on CPU."""
    if device.type == "cuda":
        return {"kind": "cuda_max_allocated", "bytes": int(torch.cuda.max_memory_allocated(device))}
    return {"kind": "process_peak_rss", "bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _process_group_backend() -> str | None:
    """The backend(s) the run's collectives used, e.g. "nccl", "gloo", or "cpu:gloo,cuda:nccl" for host state."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return str(torch.distributed.get_backend())
    return None


def _checkpoint_path(trainer: L.Trainer, attribute: str) -> str | None:
    callback = trainer.checkpoint_callback
    return (getattr(callback, attribute, None) or None) if callback is not None else None
