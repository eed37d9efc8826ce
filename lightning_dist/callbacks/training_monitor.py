"""Live training health: step time, throughput, model FLOPs utilisation, peak memory and gradient norm, logged as
the run goes; a run whose loss or gradients stop being finite is stopped, on every rank, with a message saying where
it happened.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from torch import nn
from typing_extensions import override

from lightning_dist._compat.lightning import logs_this_step
from lightning_dist.callbacks.finite_watch import FiniteWatch, NonFiniteError
from lightning_dist.callbacks.run_summary import input_shape, peak_memory, throughput
from lightning_dist.parallel.dims import parallel_dims_of
from lightning_dist.parallel.experts import count_routed_tokens
from lightning_dist.parallel.grad_norm import total_norm
from lightning_dist.reports.flops import ModelFlops, Utilisation, device_peak_flops

__all__ = ["NonFiniteError", "TrainingMonitor"]


class TrainingMonitor(L.Callback):
    """Logs `monitor/step_time_s`, `monitor/samples_per_s`, `monitor/tokens_per_s`, `monitor/mfu`,
    `monitor/peak_memory_gb` and `monitor/grad_norm` at the steps the loggers write (every `log_every_n_steps`), and
    under pipeline stages `monitor/pipeline_bubble`, the idle share of a step the schedule implies, and
    `monitor/pipeline_idle`, the share rank 0's stages measured over the steps since the last logged one. A model
    whose mixture-of-experts layers count their tokens per expert (`tokens_per_expert`, as `model=gpt_moe`'s do, and
    transformers' routers once hooked: parallel/experts.py) gets `monitor/expert_load/LAYER`, the most tokens an
    expert of that layer got over the mean, in rank 0's step (1: an even load; the number of experts / top k: one
    expert took every token).

    check_finite: stop at the first non-finite loss or gradient norm. Values are checked on the device as they
        come (no host synchronisation); the ranks compare notes every `check_every_n_steps` steps and before every
        checkpoint, so the run stops within that many steps, naming the step where it happened, and no checkpoint
        ever holds the damage. Where the check falls before backward, the weights are still the last good ones.
    check_every_n_steps: how often the ranks compare notes; default: the trainer's `log_every_n_steps` (logging
        synchronises with the device there anyway). 1 checks every step, before backward.
    locate_module: also name the first module whose output was not finite (one on-device check per module output).
    peak_tflops: one device's peak, for MFU (`lightning_dist/reports/flops.py`); default: NVIDIA's dense figure for
        the GPUs it lists, a matrix-product rate measured at the start on a CPU. A GPU it does not list logs no MFU.
    """

    def __init__(self, check_finite: bool = True, locate_module: bool = False, check_every_n_steps: int | None = None,
                 peak_tflops: float | None = None) -> None:
        if check_every_n_steps is not None and check_every_n_steps < 1:
            raise ValueError(
                f"callbacks.training_monitor.check_every_n_steps: {check_every_n_steps} is not a positive number of"
                " steps; choose 1 or more, or null"
            )
        self.check_finite = check_finite
        self.locate_module = locate_module
        self.check_every_n_steps = check_every_n_steps
        self.peak_tflops = peak_tflops
        self.utilisation: Utilisation | None = None  # known from the first batch of token ids on
        self._model_flops: ModelFlops | None = None
        self._peak: tuple[float, str] | None = None
        self._step_start = 0.0
        self._step_at_batch_start = 0
        self._batch_shape: tuple[int, ...] = ()
        self._watch: FiniteWatch | None = None
        self._hooks: list[Any] = []
        self._expert_layers: list[tuple[str, nn.Module]] = []

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Counted before the strategy splits the model (tensor parallelism leaves each rank its part of a layer).
        if stage == "fit" and any(True for _ in pl_module.parameters()):
            self._model_flops = ModelFlops.of(pl_module)

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._model_flops is None:  # built in configure_model: counted from its shards' full sizes
            self._model_flops = ModelFlops.of(pl_module)
        self._peak = device_peak_flops(trainer.strategy.root_device, str(trainer.precision), self.peak_tflops)
        count_routed_tokens(pl_module)  # transformers' routers count theirs too
        self._expert_layers = [(name.removeprefix("model."), module) for name, module in pl_module.named_modules()
                               if hasattr(module, "tokens_per_expert")]
        if not self.check_finite:
            return
        every = self.check_every_n_steps or trainer.log_every_n_steps or 1  # type: ignore[attr-defined]
        names = [
            f"{name or type(module).__name__} ({type(module).__name__})" for name, module in pl_module.named_modules()
        ]
        self._watch = FiniteWatch(trainer.strategy.root_device, every, module_names=names if self.locate_module else [])
        _nonfinite_checked_on_device(trainer, True)
        if self.locate_module:
            for index, module in enumerate(pl_module.modules()):
                self._hooks.append(module.register_forward_hook(self._output_check(trainer, index)))

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._watch is not None:
            _nonfinite_checked_on_device(trainer, False)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self._watch is not None:
            _nonfinite_checked_on_device(trainer, False)

    def _output_check(self, trainer: L.Trainer, index: int):
        watch = self._watch
        assert watch is not None, "module outputs are checked while a watch is kept"

        def check(module: nn.Module, args: Any, output: Any) -> None:
            if trainer.training and isinstance(output, torch.Tensor) and output.is_floating_point():
                watch.observe_module_output(index, output, trainer.global_step)
        return check

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_shape = input_shape(batch)
        self._utilisation_of(self._batch_shape)
        self._step_at_batch_start = trainer.global_step
        self._step_start = time.perf_counter()

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self._watch is not None:
            self._watch.observe_loss(loss, trainer.global_step)
            self._check_if_due(trainer.global_step)

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self._watch is None and not _logs_this_step(trainer):
            return
        norm = _gradient_norm(optimizer, trainer.strategy)
        if norm is not None:
            self._record_gradient_norm(trainer, pl_module, norm, step=trainer.global_step)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step_time = time.perf_counter() - self._step_start
        engine = getattr(trainer.strategy, "deepspeed_engine", None)
        logs = _logs_this_step(trainer)
        if engine is not None and trainer.global_step > self._step_at_batch_start and (logs or self._watch is not None):
            # DeepSpeed keeps its gradients to itself and computes their norm in the step just taken.
            norm = engine.get_global_grad_norm()
            if norm is not None:
                if not isinstance(norm, torch.Tensor):  # a float: filled on the device, not copied there (a sync)
                    norm = torch.full((), float(norm), device=trainer.strategy.root_device)
                self._record_gradient_norm(trainer, pl_module, norm, step=trainer.global_step - 1)
        if not logs:
            return
        metrics = {
            "monitor/step_time_s": step_time,
            "monitor/peak_memory_gb": peak_memory(trainer.strategy.root_device)["bytes"] / 1e9,
        }
        if self._batch_shape:
            speed = throughput(self._batch_shape, parallel_dims_of(trainer.strategy).dp_size, step_time)
            metrics.update({f"monitor/{name}": value for name, value in speed.items()})
            if self.utilisation is not None:
                self.utilisation = self.utilisation.raised_to(speed["tokens_per_s"], trainer.world_size)
                metrics["monitor/mfu"] = self.utilisation.mfu(speed["tokens_per_s"], trainer.world_size)
        bubble = getattr(trainer.strategy, "pipeline_bubble", None)
        if bubble is not None:  # the share of a step the schedule leaves each pipeline stage idle, as it implies
            metrics["monitor/pipeline_bubble"] = bubble
        clock = getattr(trainer.strategy, "pipeline_idle", None)
        idle = clock.idle_share() if clock is not None else None
        if idle is not None:  # and as this rank's stages measured it, over the steps since the last logged one
            metrics["monitor/pipeline_idle"] = idle
        # Measured on the host, logged from the host: Lightning would copy a plain float to the device (a blocking
        # copy each, every step) and read it back when writing the logs.
        host_values = {name: torch.tensor(value, dtype=torch.float64, device="cpu") for name, value in metrics.items()}
        pl_module.log_dict(host_values, on_step=True, on_epoch=False, rank_zero_only=True)
        counts = {name: layer.tokens_per_expert for name, layer in self._expert_layers}
        loads = {f"monitor/expert_load/{name}": tokens.max() / tokens.float().mean()
                 for name, tokens in counts.items() if isinstance(tokens, torch.Tensor)}
        if loads:  # on the device: read when the loggers write
            pl_module.log_dict(loads, on_step=True, on_epoch=False, rank_zero_only=True)

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        # Every rank builds the checkpoint, so all of them check together: damaged weights are never saved.
        if self._watch is not None:
            self._watch.raise_if_nonfinite(trainer.global_step)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._watch is not None:
            self._watch.raise_if_nonfinite(trainer.global_step)

    def _utilisation_of(self, batch_shape: tuple[int, ...]) -> Utilisation | None:
        """MFU's terms, once the batches are known to be (batch, sequence) token ids and the device's peak is."""
        if self.utilisation is None and len(batch_shape) == 2 and self._peak is not None and self._model_flops:
            self.utilisation = Utilisation(self._model_flops.per_token(batch_shape[1]), *self._peak)
        return self.utilisation

    def _record_gradient_norm(
        self, trainer: L.Trainer, pl_module: L.LightningModule, norm: torch.Tensor, step: int
    ) -> None:
        if _logs_this_step(trainer):  # as a tensor: Lightning reads it on the host only when it writes the logs
            pl_module.log("monitor/grad_norm", norm, on_step=True, on_epoch=False, rank_zero_only=True)
        if self._watch is not None:
            self._watch.observe_gradient_norm(norm, step)
            self._check_if_due(step)

    def _check_if_due(self, step: int) -> None:
        if self._watch is not None and (step + 1) % self._watch.window == 0:
            self._watch.raise_if_nonfinite(step)


def _nonfinite_checked_on_device(trainer: L.Trainer, checked: bool) -> None:
    """Tell the strategy (ours; Lightning's are not asked) whether this monitor is stopping the run at non-finite
    values, so that its engine need not test its gradient norm on the host every step."""
    tell = getattr(trainer.strategy, "checks_nonfinite_on_device", None)
    if tell is not None:
        tell(checked)


def _logs_this_step(trainer: L.Trainer) -> bool:
    """Whether the loggers write this step (every `log_every_n_steps`). `self.log` costs about a millisecond of
    Python each call, every step, whether or not the value is written: 7 ms a step of the default model's 160 on
    this machine for the monitor's values alone; they are logged only when they will be written."""
    return logs_this_step(trainer)


def _gradient_norm(optimizer: torch.optim.Optimizer, strategy: Any) -> torch.Tensor | None:
    """The L2 norm of the gradients `optimizer` is about to step (on the device, unread), or None where the engine
    keeps them (DeepSpeed: read from it after the step). The optimizer's parameters are the ones that train and the
    ones Lightning clips, held in a list: walking the module's took 0.45 ms of host time a step on gpu_compare's
    24-block GPT (388 parameters; `Module.parameters()` names every module as it goes), the list 0.05. FSDP2's are
    sharded (over one mesh, or two with tensor parallelism): the norm of the shards is reduced across ranks; pipeline
    stages each hold part of the model, whose norms are combined (`gradient_norm_scope`)."""
    if getattr(strategy, "deepspeed_engine", None) is not None:
        return None
    scope = getattr(strategy, "gradient_norm_scope", None)
    across, counted_elsewhere = scope() if callable(scope) else (None, set())
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]
             if p.grad is not None and id(p) not in counted_elsewhere]
    if not grads:
        return None
    return total_norm(grads, across=across)
