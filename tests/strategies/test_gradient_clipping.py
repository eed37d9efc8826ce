"""gradient_clip_val=1.0 (norm) clips the same global gradient norm under every strategy.

With plain SGD the first update is -lr x the clipped gradient, so ||w1 - w0|| / lr is the post-clip global norm
over the whole (gathered) model: it must be 1.0 when the raw gradient explodes, and w1 must agree across strategies.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import in_the_suite, run_train

pytestmark = pytest.mark.slow

LR = 0.01
EXPLODING_SGD_STEP = (
    "model._target_=tests.models.checkpoint_probe.CheckpointProbeGPT",
    "+model.gathered_path=${paths.output_dir}/gathered_state.pt",
    "+model.loss_multiplier=1000",  # raw gradient norm in the hundreds
    "optimizer=sgd", f"model.optimizer.lr={LR}", "model.optimizer.momentum=0",
    "trainer.max_steps=1", "test=false", "trainer.gradient_clip_val=1.0", "trainer.gradient_clip_algorithm=norm",
)


@pytest.fixture(scope="module")
def clipped_updates(tmp_path_factory, deepspeed_ops):
    updates = {}

    def get(name: str) -> dict[str, torch.Tensor]:
        if name not in updates:
            run = run_train(tmp_path_factory.mktemp(name), f"strategy={name}", *EXPLODING_SGD_STEP)
            assert run.process.returncode == 0, run.output[-3000:]
            before = torch.load(run.run_dir / "initial_state.pt")
            after = torch.load(run.run_dir / "gathered_state.pt")
            # Tied weights appear under two names but are one parameter: count each tensor once.
            names = [n for n in after if n != "model.lm_head.weight" and after[n].is_floating_point() and n != "bytes_seen"]
            updates[name] = {n: after[n] - before[n] for n in names}
        return updates[name]

    return get


# One preset per clipping path: DDP's local gradients, FSDP2's sharded ones (on the host when offloaded), ZeRO-1/2's
# partitions (DeepSpeed's CPU Adam when offloaded), ZeRO-3's. Activation checkpointing and SHARD_GRAD_OP change
# neither the gradients nor where they are clipped; ZeRO-1 clips as ZeRO-2 does (one optimizer class).
CLIPPING_PATHS = ["ddp", "fsdp", "fsdp_cpu_offload", "deepspeed_stage_2", "deepspeed_stage_2_offload", "deepspeed_stage_3",
                  "deepspeed_stage_3_offload"]


@pytest.mark.parametrize("name", in_the_suite(CLIPPING_PATHS, ["ddp", "deepspeed_stage_3"]))
def test_post_clip_global_norm_is_one_and_the_update_matches_ddp(name, clipped_updates):
    update = clipped_updates(name)
    post_clip_norm = math.sqrt(sum(float(d.double().pow(2).sum()) for d in update.values())) / LR
    assert post_clip_norm == pytest.approx(1.0, abs=1e-3)
    reference = clipped_updates("ddp")
    for key, delta in update.items():
        torch.testing.assert_close(delta, reference[key], rtol=0, atol=1e-7, msg=key)
