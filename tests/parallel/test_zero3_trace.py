"""ZeRO-3's prefetch trace survives Lightning's forward redirection (the root module running inside itself)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_dist.parallel.zero3_trace import restart_trace_at_outermost_forward
from tests.conftest import run_train


class RedirectedRoot(nn.Module):
    """Runs itself again from inside, as a LightningModule's training_step does under forward redirection."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, inner: bool = False) -> torch.Tensor:
        return self.layer(x) if inner else self(x, inner=True)


def fake_engine(root: nn.Module, resets: list[str]):
    coordinator = SimpleNamespace(reset_step=lambda: resets.append("reset"))
    offload = SimpleNamespace(module=root, get_param_coordinator=lambda: coordinator)
    offload.fwd_pre_hook = root.register_forward_pre_hook(lambda *_: coordinator.reset_step())  # DeepSpeed's own
    return SimpleNamespace(optimizer=SimpleNamespace(parameter_offload=offload))


def test_the_trace_restarts_once_per_outermost_forward():
    root, resets = RedirectedRoot(), []
    engine = fake_engine(root, resets)
    root(torch.ones(1, 2))
    assert resets == ["reset", "reset"]  # DeepSpeed's hook: twice per step, which invalidates its trace
    resets.clear()
    assert restart_trace_at_outermost_forward(engine)
    for _ in range(3):
        root(torch.ones(1, 2))
    assert resets == ["reset"] * 3


def test_a_failed_forward_does_not_leave_the_depth_behind():
    root, resets = RedirectedRoot(), []
    restart_trace_at_outermost_forward(fake_engine(root, resets))
    with pytest.raises(RuntimeError):
        root(torch.ones(1, 3))  # wrong shape: raises inside the inner call
    root(torch.ones(1, 2))
    assert resets == ["reset", "reset"]


def test_without_zero_3_there_is_nothing_to_replace():
    assert restart_trace_at_outermost_forward(SimpleNamespace(optimizer=object())) is False


@pytest.mark.slow
def test_under_lightning_zero_3_keeps_its_trace_from_the_second_step_on(tmp_path, deepspeed_ops):
    run = run_train(tmp_path, "strategy=deepspeed_stage_3", "trainer.max_steps=4", "test=false",
                    "+callbacks.trace._target_=tests.probes.Zero3TraceProbe", "+callbacks.trace.directory=${paths.output_dir}")
    assert run.process.returncode == 0, run.output[-3000:]
    for rank in (0, 1):
        # The sanity check's validation left an eval trace, which step 1 discards; step 2 records the training
        # trace and every later step follows it. Before the fix it was invalid after every step.
        assert json.loads((tmp_path / f"zero3_trace_rank{rank}.json").read_text()) == [False, False, True, True]
