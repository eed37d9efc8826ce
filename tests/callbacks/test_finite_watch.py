"""The on-device record of the first non-finite value: what it says, read once, without a process group."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dist.callbacks import TrainingMonitor
from lightning_dist.callbacks.finite_watch import FiniteWatch, NonFiniteError

NAN, INF = float("nan"), float("inf")


def watch_after(losses: list[float], norms: list[float] | None = None, window: int = 4) -> FiniteWatch:
    watch = FiniteWatch(torch.device("cpu"), window, module_names=["model (GPT)", "model.head (Linear)"])
    for step, loss in enumerate(losses):
        watch.observe_loss(torch.tensor(loss), step)
        if norms is not None:
            watch.observe_gradient_norm(torch.tensor(norms[step]), step)
    return watch


def test_finite_values_raise_nothing():
    watch_after([4.2, 4.1, 4.0, 3.9], norms=[1.0, 0.9, 0.8, 0.7]).raise_if_nonfinite(3)


def test_a_nan_loss_is_reported_at_its_own_step_when_found_later():
    watch = watch_after([4.2, 4.1, NAN, 3.9, NAN])
    with pytest.raises(NonFiniteError) as error:
        watch.raise_if_nonfinite(4)
    assert str(error.value) == ("non-finite loss (by rank: nan) at global step 2 on rank(s) 0 (found at the check of step 4);"
                                " no module's output was non-finite")


def test_an_infinite_gradient_norm_with_a_finite_loss_is_reported_with_its_value():
    watch = watch_after([4.2, 4.1, 4.0], norms=[1.0, INF, 2.0])
    with pytest.raises(NonFiniteError, match=r"^non-finite gradient norm \(inf\) at global step 1 on rank\(s\) 0 \(found at the check of step 2\)"):
        watch.raise_if_nonfinite(2)


def test_across_ranks_the_earliest_step_wins_and_every_ranks_loss_at_it_is_given():
    # Two ranks' records as gathered: rank 1's loss went NaN at step 5, rank 0's only at step 6 (through the weights).
    watch = FiniteWatch(torch.device("cpu"), window=4, module_names=["model (GPT)", "model.blocks.1.mlp (Sequential)"])
    rank0 = [6, 6, NAN, 0, 6, 4.0, 4.1, NAN, 3.9]   # loss step, grad step, grad norm, module, module step, losses 4..7
    rank1 = [5, 5, NAN, 1, 5, 4.0, NAN, NAN, 3.8]
    message = watch.describe([rank0, rank1], current_step=7)
    assert message == ("non-finite loss (by rank: 4.1, nan) at global step 5 on rank(s) 1 (found at the check of step 7);"
                       " first module with a non-finite output: model.blocks.1.mlp (Sequential) on rank 1")
    assert watch.describe([[-1.0, -1.0, -1.0, -1.0, -1.0, 4.0, 4.0, 4.0, 4.0]] * 2, current_step=7) is None


def test_only_the_first_non_finite_module_output_is_kept():
    watch = FiniteWatch(torch.device("cpu"), window=2, module_names=["a (Linear)", "b (GELU)", "c (Linear)"])
    watch.observe_module_output(0, torch.ones(3), step=0)
    watch.observe_module_output(1, torch.tensor([1.0, NAN]), step=0)
    watch.observe_module_output(2, torch.tensor([NAN]), step=0)
    watch.observe_loss(torch.tensor(NAN), 0)
    assert watch.record[3].item() == 1 and watch.record[4].item() == 0
    assert math.isnan(watch.record[5].item())


def test_check_interval_must_be_positive():
    with pytest.raises(ValueError, match=r"^callbacks.training_monitor.check_every_n_steps: 0 is not a positive number of steps; choose 1 or more, or null$"):
        TrainingMonitor(check_every_n_steps=0)


def test_the_monitor_hands_lightning_host_tensors_not_floats():
    """Lightning turns a logged float into a tensor on the module's device: a blocking host-to-device copy per value
    per step on a GPU. The monitor's host measurements are logged as host tensors; the gradient norm stays where it
    was computed."""
    from types import SimpleNamespace

    logged = {}
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), world_size=2, global_step=0,
                              _logger_connector=SimpleNamespace(should_update_logs=False))
    module = SimpleNamespace(log_dict=lambda values, **kwargs: logged.update(values))
    monitor = TrainingMonitor(check_finite=False)
    monitor.on_train_batch_start(trainer, module, (torch.zeros(4, 8, dtype=torch.long),), 0)
    monitor.on_train_batch_end(trainer, module, None, None, 0)
    assert logged == {}  # not a step the loggers write: `self.log` costs a millisecond a call, for nothing
    trainer._logger_connector.should_update_logs = True
    monitor.on_train_batch_end(trainer, module, None, None, 0)
    assert sorted(logged) == ["monitor/peak_memory_gb", "monitor/samples_per_s", "monitor/step_time_s", "monitor/tokens_per_s"]
    assert all(isinstance(value, torch.Tensor) and value.device.type == "cpu" for value in logged.values()), logged
