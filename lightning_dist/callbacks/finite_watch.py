"""Where the loss, the gradient norm or a module's output first stopped being finite, recorded on the device.

Reading a value on the host (`.item()`, `bool(...)`) waits for the GPU to finish everything queued before it: done on
every micro-batch, that stalls the pipeline. This record is updated with device-side operations only; the host reads
it, once and for all ranks together, when `raise_if_nonfinite` is called.
"""

from __future__ import annotations

import math

import torch

from lightning_dist.parallel.devices import gather_tensors

_NOT_YET = -1.0
# The record is one float64 vector per rank, so that one all-gather and one host read fetch everything:
_LOSS_STEP, _GRAD_STEP, _GRAD_NORM, _MODULE, _MODULE_STEP, _RECENT_LOSSES = 0, 1, 2, 3, 4, 5


class NonFiniteError(RuntimeError):
    """The loss or the gradient norm became NaN or infinite; the run stopped before saving the damage."""


class FiniteWatch:
    """On-device record of the first non-finite loss, gradient norm and module output of this rank.

    window: the most steps between two `raise_if_nonfinite` calls; the losses of that many recent steps are kept,
        so that the message can give every rank's loss at the step where the first one went wrong.
    module_names: names by module index, for `observe_module_output`.
    """

    def __init__(self, device: torch.device, window: int, module_names: list[str] | None = None) -> None:
        self.window = window
        self.module_names = module_names or []
        self.record = torch.full((_RECENT_LOSSES + window,), _NOT_YET, dtype=torch.float64, device=device)
        self.record[_RECENT_LOSSES:] = 0.0

    def observe_loss(self, loss: torch.Tensor, step: int) -> None:
        loss = self._on_device(loss)
        self.record[_RECENT_LOSSES + step % self.window] = loss
        self._mark_first(_LOSS_STEP, ~torch.isfinite(loss), step)

    def observe_gradient_norm(self, norm: torch.Tensor, step: int) -> None:
        norm = self._on_device(norm)
        first = self._mark_first(_GRAD_STEP, ~torch.isfinite(norm), step)
        self.record[_GRAD_NORM] = torch.where(first, norm, self.record[_GRAD_NORM])

    def observe_module_output(self, index: int, output: torch.Tensor, step: int) -> None:
        # Forward hooks fire as modules finish, innermost first: the first one marked is where it started.
        first = self._mark_first(_MODULE, ~torch.isfinite(output.detach()).all(), index)
        self.record[_MODULE_STEP] = torch.where(first, step, self.record[_MODULE_STEP])

    def raise_if_nonfinite(self, current_step: int) -> None:
        """Compare notes across ranks (a collective: every rank calls it at the same point); raise NonFiniteError,
        with the same message on every rank, if any rank saw a non-finite value."""
        message = self.describe(gather_tensors(self.record), current_step)
        if message is not None:
            raise NonFiniteError(message)

    def describe(self, records: list[list[float]], current_step: int) -> str | None:
        """The message for every rank's record (`[[rank 0's], ...]`), or None when all were finite."""
        loss_step = _first(records, _LOSS_STEP)
        grad_step = _first(records, _GRAD_STEP)
        if loss_step is None and grad_step is None:
            return None
        step: int
        if loss_step is not None and (grad_step is None or loss_step <= grad_step):
            losses = [record[_RECENT_LOSSES + loss_step % self.window] for record in records]
            what, step = f"loss (by rank: {', '.join(f'{value:.4g}' for value in losses)})", loss_step
            ranks = [rank for rank, record in enumerate(records) if record[_LOSS_STEP] == loss_step]
        else:
            assert grad_step is not None
            what, step = f"gradient norm ({records[0][_GRAD_NORM]})", grad_step
            ranks = [rank for rank, record in enumerate(records) if record[_GRAD_STEP] == grad_step]
        message = f"non-finite {what} at global step {step} on rank(s) {', '.join(map(str, ranks))}"
        if current_step != step:
            message += f" (found at the check of step {current_step})"
        if self.module_names:
            # A rank whose modules went bad only later took the damage in through the weights: not where it began.
            located = [
                (rank, int(record[_MODULE])) for rank, record in enumerate(records) if record[_MODULE_STEP] == step
            ]
            message += "; first module with a non-finite output: " + ", ".join(
                f"{self.module_names[index]} on rank {rank}" for rank, index in located
            ) if located else "; no module's output was non-finite"
        return message

    def _on_device(self, value: torch.Tensor) -> torch.Tensor:
        return value.detach().to(self.record.device, torch.float64, non_blocking=True).reshape(())

    def _mark_first(self, slot: int, bad: torch.Tensor, value: int) -> torch.Tensor:
        first = bad & (self.record[slot] == _NOT_YET)
        self.record[slot] = torch.where(first, value, self.record[slot])
        return first


def _first(records: list[list[float]], slot: int) -> int | None:
    marked = [record[slot] for record in records if record[slot] != _NOT_YET and math.isfinite(record[slot])]
    return int(min(marked)) if marked else None
