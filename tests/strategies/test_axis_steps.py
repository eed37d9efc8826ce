"""Each step runs through the parallel axes a strategy sets up on the rank, outermost first, then Lightning's
(lightning_dist/strategies/axis_steps.py); an axis may run the step it is handed on its part of the batch, or run the
step itself instead."""

from __future__ import annotations

from lightning_dist.strategies.axis_steps import StepsThroughAxes


class Lightning:
    """Lightning's strategy, as the mixin calls on to it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def training_step(self, batch, batch_idx):
        self.calls.append(f"lightning training_step {batch} {batch_idx}")
        return f"loss of {batch}"

    def validation_step(self, batch, batch_idx):
        self.calls.append(f"lightning validation_step {batch}")
        return None

    def test_step(self, batch, batch_idx):
        self.calls.append(f"lightning test_step {batch}")
        return None

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        self.calls.append(f"lightning backward {closure_loss} {kwargs}")
        return closure_loss


class Sharding:
    """An axis that runs the step it is handed on its part of the batch (as context parallelism does)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def run_step(self, strategy, kind, run, batch, *args, **kwargs):
        strategy.calls.append(f"{self.name} {kind}")
        return run(f"{self.name}({batch})", *args, **kwargs)

    def run_backward(self, strategy, closure_loss, run):
        strategy.calls.append(f"{self.name} backward")
        return run()


class RunsItself:
    """An axis that runs the step instead (as pipeline stages do)."""

    def run_step(self, strategy, kind, run, batch, *args, **kwargs):
        return f"scheduled {kind} of {batch}"

    def run_backward(self, strategy, closure_loss, run):
        return "gradients added"


class Strategy(StepsThroughAxes, Lightning):
    def __init__(self, axes) -> None:
        super().__init__()
        self.axes = axes

    def step_axes(self):
        return self.axes


def test_without_axes_the_step_is_lightning_s():
    strategy = Strategy([])
    assert strategy.training_step("b", 0) == "loss of b"
    assert strategy.backward("l", None, scale_wrt_gas=False) == "l"
    assert strategy.calls == ["lightning training_step b 0", "lightning backward l {'scale_wrt_gas': False}"]


def test_the_outermost_axis_hands_its_part_of_the_batch_to_the_next():
    strategy = Strategy([Sharding("outer"), Sharding("inner")])
    assert strategy.training_step("b", 3) == "loss of inner(outer(b))"
    strategy.validation_step("v", 0)
    strategy.test_step("t", 0)
    assert strategy.backward("l", None) == "l"
    assert strategy.calls == [
        "outer training_step", "inner training_step", "lightning training_step inner(outer(b)) 3",
        "outer validation_step", "inner validation_step", "lightning validation_step inner(outer(v))",
        "outer test_step", "inner test_step", "lightning test_step inner(outer(t))",
        "outer backward", "inner backward", "lightning backward l {}"]


def test_an_axis_that_runs_the_step_itself_replaces_lightning_s():
    strategy = Strategy([RunsItself()])
    assert strategy.training_step("b", 0) == "scheduled training_step of b"
    assert strategy.validation_step("v", 0) == "scheduled validation_step of v"
    assert strategy.backward("l", None) == "gradients added"
    assert strategy.calls == []
