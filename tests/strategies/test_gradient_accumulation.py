"""accumulate_grad_batches=4 with micro-batch 4 trains exactly like batch 16: same samples, same mean gradient."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import in_the_suite, run_train

pytestmark = pytest.mark.slow

# Plain SGD: the update is -lr x the gradient, so a gradient scaled by any factor (accumulated micro-batches
# summed instead of averaged, or divided twice) moves the weights by that factor. Adam would hide it: it divides
# the gradient by its own running magnitude.
PROBE = ("model._target_=tests.models.checkpoint_probe.CheckpointProbeGPT",
         "+model.gathered_path=${paths.output_dir}/gathered_state.pt",
         "optimizer=sgd", "model.optimizer.lr=0.1", "model.optimizer.momentum=0",
         "trainer.max_steps=6", "test=false")


@pytest.fixture(scope="module")
def full_batch(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The reference: batch 16 in one step, under ddp. Every strategy computes the same mathematics (reduction order
    aside: tests/strategies/test_equivalence.py), so one reference serves them all."""
    run = run_train(tmp_path_factory.mktemp("full"), "strategy=ddp", *PROBE, "data.batch_size=16")
    assert run.process.returncode == 0, run.output[-3000:]
    assert run.summary["global_step"] == 6
    return torch.load(run.run_dir / "gathered_state.pt")


@pytest.mark.parametrize("strategy", in_the_suite(["ddp", "fsdp", "deepspeed_stage_2", "deepspeed_stage_3"], ["deepspeed_stage_3"]))
def test_accumulated_micro_batches_match_the_full_batch(strategy, full_batch, tmp_path, deepspeed_ops):
    run = run_train(tmp_path, f"strategy={strategy}", *PROBE, "data.batch_size=4", "trainer.accumulate_grad_batches=4")
    assert run.process.returncode == 0, run.output[-3000:]
    assert run.summary["global_step"] == 6
    accumulated = torch.load(run.run_dir / "gathered_state.pt")
    assert torch.equal(full_batch["bytes_seen"], accumulated["bytes_seen"])  # the same samples went in
    # Summation order differs (4 partial means vs one mean, and each strategy's own reductions): measured 1.5e-8 after
    # 6 steps. A gradient 4x too large (micro-batch losses summed, not averaged) moves weights by up to 0.46
    # (measured, same runs with the loss x4).
    for name, tensor in full_batch.items():
        torch.testing.assert_close(accumulated[name], tensor, rtol=0, atol=1e-6, msg=name)
