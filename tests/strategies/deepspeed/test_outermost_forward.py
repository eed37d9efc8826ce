"""DeepSpeed's root-module hooks fire once per forward under Lightning's forward redirection (the root module running
inside itself): ZeRO-3's prefetch trace survives, and the engine's timers start once."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_dist.strategies.deepspeed.outermost_forward import run_root_hooks_once_per_forward
from tests.conftest import run_train


class RedirectedRoot(nn.Module):
    """Runs itself again from inside, as a LightningModule's training_step does under forward redirection."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, inner: bool = False) -> torch.Tensor:
        return self.layer(x) if inner else self(x, inner=True)


def fake_engine(root: nn.Module, events: list[str]):
    """DeepSpeed's three root hooks, registered as the engine registers them (the prologue with kwargs)."""
    coordinator = SimpleNamespace(reset_step=lambda: events.append("reset"))
    offload = SimpleNamespace(module=root, get_param_coordinator=lambda: coordinator)
    offload.fwd_pre_hook = root.register_forward_pre_hook(lambda *_: coordinator.reset_step())
    prologue = root.register_forward_pre_hook(lambda module, args, kwargs: events.append("start timers"), with_kwargs=True)
    epilogue = root.register_forward_hook(lambda *_: events.append("stop timers"))
    return SimpleNamespace(module=root, optimizer=SimpleNamespace(parameter_offload=offload),
                           module_forward_pre_hook=prologue, module_forward_post_hook=epilogue)


ONE_FORWARD = ["reset", "start timers", "stop timers"]


def test_each_hook_fires_once_per_outermost_forward():
    root, events = RedirectedRoot(), []
    engine = fake_engine(root, events)
    root(torch.ones(1, 2))
    # Unguarded: nested, so the trace restarts mid-step and the timers start twice.
    assert events == ["reset", "start timers", "reset", "start timers", "stop timers", "stop timers"]
    events.clear()
    assert run_root_hooks_once_per_forward(engine) == 3
    for _ in range(3):
        root(torch.ones(1, 2))
    assert events == ONE_FORWARD * 3


def test_a_failed_forward_does_not_leave_the_depth_behind():
    root, events = RedirectedRoot(), []
    run_root_hooks_once_per_forward(fake_engine(root, events))
    with pytest.raises(RuntimeError):
        root(torch.ones(1, 3))  # wrong shape: raises inside the inner call
    events.clear()
    root(torch.ones(1, 2))
    assert events == ONE_FORWARD


def test_an_engine_without_root_hooks_is_left_alone():
    root = RedirectedRoot()
    assert run_root_hooks_once_per_forward(SimpleNamespace(module=root, optimizer=object())) == 0
    assert not root._forward_pre_hooks and not root._forward_hooks


@pytest.mark.slow
def test_under_lightning_zero_3_keeps_its_trace_from_the_second_step_on(tmp_path, deepspeed_ops):
    run = run_train(tmp_path, "strategy=deepspeed_stage_3", "trainer.max_steps=4", "test=false",
                    "+callbacks.trace._target_=tests.probes.Zero3TraceProbe", "+callbacks.trace.directory=${paths.output_dir}")
    assert run.process.returncode == 0, run.output[-3000:]
    for rank in (0, 1):
        # The sanity check's validation left an eval trace, which step 1 discards; step 2 records the training
        # trace and every later step follows it. Before the fix it was invalid after every step.
        assert json.loads((tmp_path / f"zero3_trace_rank{rank}.json").read_text()) == [False, False, True, True]
