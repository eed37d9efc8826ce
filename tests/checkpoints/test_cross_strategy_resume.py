"""Every preset resumes from another preset's checkpoint: the weights arrive exactly, and the next two steps (which
need Adam's moments and step count, and the data position) give the source run's losses.

Each target preset reads a checkpoint of another family, so every checkpoint format (DDP's file, FSDP's sharded
directory, ZeRO-2 and ZeRO-3 directories, with and without activation checkpointing or offload) is read by
several strategies; and DeepSpeed reads the ZeRO directories its own loader cannot. The whole matrix:
`python -m scripts.resume_matrix`.
"""

from __future__ import annotations

import pytest
import torch

from lightning_dist.checkpoints.consolidate import load_consolidated
from lightning_dist.reports.equivalence import run_strategy
from tests.conftest import CURVE_OVERRIDES, in_the_suite

pytestmark = pytest.mark.slow

# (target preset, the preset whose step-15 checkpoint it resumes from)
PAIRS = [
    ("ddp", "deepspeed_stage_3"),
    ("fsdp", "deepspeed_stage_2"),
    ("fsdp_activation_checkpointing", "deepspeed_stage_2"),
    ("fsdp_cpu_offload", "ddp"),
    ("fsdp_shard_grad_op", "deepspeed_stage_3_offload"),
    ("deepspeed_stage_1", "fsdp_activation_checkpointing"),
    ("deepspeed_stage_2", "ddp"),
    ("deepspeed_stage_2_offload", "fsdp"),
    ("deepspeed_stage_3", "fsdp_shard_grad_op"),
    ("deepspeed_stage_3", "fsdp"),
    ("deepspeed_stage_3_offload", "fsdp_cpu_offload"),
    # DeepSpeed into DeepSpeed where its own loader cannot: across ZeRO-3 and ZeRO-1/2, into an offloaded optimizer
    ("deepspeed_stage_3", "deepspeed_stage_2"),
    ("deepspeed_stage_1", "deepspeed_stage_3_offload"),
    ("deepspeed_stage_2_offload", "deepspeed_stage_2"),
    ("deepspeed_stage_3_offload", "deepspeed_stage_3"),
]
TWO_STEPS = (*CURVE_OVERRIDES[:2], "trainer.max_steps=17", "callbacks.model_checkpoint=null",
             "callbacks.validate_at_max_steps=null", "trainer.num_sanity_val_steps=0")


# In the suite: ZeRO-3's directory read by DDP, ZeRO-2's by FSDP, DDP's file by ZeRO-2, FSDP's sharded directory by
# ZeRO-3, and ZeRO-3 from ZeRO-2, which DeepSpeed's own loader cannot read.
IN_THE_SUITE = [("ddp", "deepspeed_stage_3"), ("fsdp", "deepspeed_stage_2"), ("deepspeed_stage_2", "ddp"),
                ("deepspeed_stage_3", "fsdp"), ("deepspeed_stage_3", "deepspeed_stage_2")]


@pytest.mark.parametrize(("target", "source_name"), in_the_suite(PAIRS, IN_THE_SUITE, unpack=True),
                         ids=[f"{t}_from_{s}" for t, s in PAIRS])
def test_resumes_another_presets_checkpoint(target, source_name, curve_runs, tmp_path):
    source = curve_runs(source_name)
    checkpoint = source.run_dir / "checkpoints" / "step000015.ckpt"
    resumed = run_strategy(target, [*TWO_STEPS, f"ckpt_path={checkpoint}"], tmp_path)
    assert resumed.returncode == 0
    saved = load_consolidated(checkpoint)["state_dict"]
    restored = torch.load(resumed.run_dir / "initial_state.pt")
    assert set(restored) == set(saved)
    for name, tensor in saved.items():
        torch.testing.assert_close(restored[name], tensor, rtol=0, atol=0, msg=name)
    assert sorted(resumed.losses) == [15, 16]
    for step in (15, 16):
        assert resumed.losses[step] == pytest.approx(source.losses[step], rel=1e-5), step
