"""accumulate_grad_batches=4 with micro-batch 4 trains exactly like batch 16: same samples, same mean gradient."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_train

pytestmark = pytest.mark.slow

# Plain SGD: the update is -lr x the gradient, so a gradient scaled by any factor (accumulated micro-batches
# summed instead of averaged, or divided twice) moves the weights by that factor. Adam would hide it: it divides
# the gradient by its own running magnitude.
PROBE = ("model._target_=tests.models.checkpoint_probe.CheckpointProbeGPT",
         "+model.gathered_path=${paths.output_dir}/gathered_state.pt",
         "optimizer=sgd", "model.optimizer.lr=0.1", "model.optimizer.momentum=0",
         "trainer.max_steps=6", "test=false")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "deepspeed_stage_2", "deepspeed_stage_3"])
def test_accumulated_micro_batches_match_the_full_batch(strategy, tmp_path, deepspeed_ops):
    runs = {
        label: run_train(tmp_path / label, f"strategy={strategy}", *PROBE, *overrides)
        for label, overrides in {
            "full": ("data.batch_size=16",),
            "accumulated": ("data.batch_size=4", "trainer.accumulate_grad_batches=4"),
        }.items()
    }
    for run in runs.values():
        assert run.process.returncode == 0, run.output[-3000:]
        assert run.summary["global_step"] == 6
    full, accumulated = (torch.load(runs[k].run_dir / "gathered_state.pt") for k in ("full", "accumulated"))
    assert torch.equal(full["bytes_seen"], accumulated["bytes_seen"])  # the same samples went in
    # Summation order differs (4 partial means vs one mean): measured 1.5e-8 after 6 steps. A gradient 4x too large
    # (micro-batch losses summed, not averaged) moves weights by up to 0.46 (measured, same runs with the loss x4).
    for name, tensor in full.items():
        torch.testing.assert_close(accumulated[name], tensor, rtol=0, atol=1e-6, msg=name)
