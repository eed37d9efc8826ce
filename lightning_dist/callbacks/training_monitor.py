"""Live training health: step time, throughput, peak memory and gradient norm, logged as the run goes; a run
whose loss or gradients stop being finite is stopped at that step, on every rank, with a message saying where.
"""

from __future__ import annotations

import math
import time
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_dist.callbacks.run_summary import gather_objects, input_shape, peak_memory, throughput


class NonFiniteError(RuntimeError):
    """The loss or the gradient norm became NaN or infinite; training stopped before the weights took it in."""


class TrainingMonitor(L.Callback):
    """Logs `monitor/step_time_s`, `monitor/samples_per_s`, `monitor/tokens_per_s`, `monitor/peak_memory_gb` and
    `monitor/grad_norm` every step (the logger's own interval applies).

    check_finite: stop at the first non-finite loss (checked across ranks before backward, so the weights are still
        those of the step before) or gradient norm.
    locate_module: also name the first module whose output was not finite; costs one check per module output.
    """

    def __init__(self, check_finite: bool = True, locate_module: bool = False) -> None:
        self.check_finite = check_finite
        self.locate_module = locate_module
        self._step_start = 0.0
        self._batch_shape: tuple[int, ...] = ()
        self._first_nonfinite_module: str | None = None
        self._hooks: list[Any] = []

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.locate_module:
            for name, module in pl_module.named_modules():
                self._hooks.append(module.register_forward_hook(self._output_check(name or type(module).__name__)))

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _output_check(self, name: str):
        def check(module: nn.Module, args: Any, output: Any) -> None:
            if self._first_nonfinite_module is None and isinstance(output, torch.Tensor) and output.is_floating_point():
                if not bool(torch.isfinite(output).all()):
                    self._first_nonfinite_module = f"{name} ({type(module).__name__})"
        return check

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._first_nonfinite_module = None
        self._batch_shape = input_shape(batch)
        self._step_start = time.perf_counter()

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if not self.check_finite:
            return
        # Every rank takes part, so that all of them stop together and say the same thing.
        losses = trainer.strategy.all_gather(loss.detach().float().reshape(1)).reshape(-1).tolist()
        ranks = [rank for rank, value in enumerate(losses) if not math.isfinite(value)]
        if ranks:
            by_rank = ", ".join(f"{value:.4g}" for value in losses)
            raise NonFiniteError(self._message(trainer, f"loss (by rank: {by_rank})", ranks))

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        norm = _gradient_norm(pl_module)
        if norm is not None:
            self._check_gradient_norm(trainer, pl_module, norm)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        step_time = time.perf_counter() - self._step_start
        engine = getattr(trainer.strategy, "deepspeed_engine", None)
        if engine is not None:  # DeepSpeed keeps its gradients to itself and computes their norm in its step
            norm = engine.get_global_grad_norm()
            if norm is not None:
                self._check_gradient_norm(trainer, pl_module, float(norm))
        metrics = {"monitor/step_time_s": step_time, "monitor/peak_memory_gb": peak_memory(trainer.strategy.root_device)["bytes"] / 1e9}
        if self._batch_shape:
            speed = throughput(self._batch_shape, trainer.world_size, step_time)
            metrics.update({f"monitor/{name}": value for name, value in speed.items()})
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)

    def _check_gradient_norm(self, trainer: L.Trainer, pl_module: L.LightningModule, norm: float) -> None:
        pl_module.log("monitor/grad_norm", norm, on_step=True, on_epoch=False, rank_zero_only=True)
        # The norm is taken over all ranks' gradients (after their reduction), so every rank decides alike.
        if self.check_finite and not math.isfinite(norm):
            raise NonFiniteError(self._message(trainer, f"gradient norm ({norm})", list(range(trainer.world_size))))

    def _message(self, trainer: L.Trainer, what: str, ranks: list[int]) -> str:
        message = f"non-finite {what} at global step {trainer.global_step} on rank(s) {', '.join(map(str, ranks))}"
        if self.locate_module:
            modules = gather_objects(self._first_nonfinite_module)
            message += "; first module with a non-finite output: " + ", ".join(
                f"{module} on rank {rank}" for rank, module in enumerate(modules) if module
            ) if any(modules) else "; no module's output was non-finite"
        return message


def _gradient_norm(module: nn.Module) -> float | None:
    """The L2 norm of all gradients, or None where the engine keeps them (DeepSpeed). FSDP2's are sharded."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return None
    norm = torch.nn.utils.get_total_norm(grads)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
