"""A tensor-parallel checkpoint moves to the data-parallel presets and back, and across tensor-parallel sizes.

The source trains under `fsdp_tp` on 2 ranks (1 data-parallel x 2 tensor-parallel) for 30 steps with a checkpoint
at step 15. Each target resumes that checkpoint on 1 rank (the same single data-parallel rank, so the same batches),
its weights arrive exactly, and its steps 15 to 17 give the source's losses; it saves at step 17, and `fsdp_tp` on
2 ranks resumes that checkpoint in turn, its steps 17 and 18 again the source's. So each pair is tested both ways
with one source run: DCP's 2-D shards into DDP's file, FSDP's 1-D shards and ZeRO-2's partitions, and out of them.
A damaged or mixed tensor-parallel shard is refused, naming it.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from lightning_dist.checkpoints.consolidate import load_consolidated
from lightning_dist.checkpoints.formats import CheckpointError
from lightning_dist.checkpoints.manifest import MANIFEST
from lightning_dist.checkpoints.whole import check_whole
from lightning_dist.reports.equivalence import StrategyCurve, run_strategy
from tests.conftest import CURVE_OVERRIDES, in_the_suite

pytestmark = pytest.mark.slow

ONE_RANK = "trainer.devices=1"
# (target preset, its overrides): one data-parallel rank, as the source has
TARGETS = {
    "ddp": ("ddp", ONE_RANK),
    "fsdp": ("fsdp", ONE_RANK),
    "deepspeed_stage_2": ("deepspeed_stage_2", ONE_RANK),
    "fsdp_tp, tensor_parallel_size=1": ("fsdp_tp", ONE_RANK, "strategy.tensor_parallel_size=1"),
}
# Steps past the checkpoint resumed, with a save at step 17 for the hop back (during the run: a save at the end of a
# run that max_steps stopped counts the epoch as finished, and a resume from it starts the next).
CONTINUED = (*CURVE_OVERRIDES[:2], "callbacks.model_checkpoint.monitor=null", "callbacks.model_checkpoint.save_top_k=-1",
             "callbacks.model_checkpoint.every_n_train_steps=17", "callbacks.validate_at_max_steps=null",
             "trainer.num_sanity_val_steps=0")


@pytest.fixture(scope="module")
def source(tmp_path_factory, deepspeed_ops) -> StrategyCurve:
    run = run_strategy("fsdp_tp", list(CURVE_OVERRIDES), tmp_path_factory.mktemp("fsdp_tp_source"))
    assert run.returncode == 0 and sorted(run.losses) == list(range(30))
    return run


def _continue(name: str, overrides: tuple[str, ...], checkpoint, steps: int, run_dir) -> StrategyCurve:
    run = run_strategy(name, [*CONTINUED, *overrides, f"trainer.max_steps={steps}", f"ckpt_path={checkpoint}"], run_dir)
    assert run.returncode == 0
    return run


def _assert_restored(run: StrategyCurve, checkpoint) -> None:
    saved = load_consolidated(checkpoint)["state_dict"]
    restored = torch.load(run.run_dir / "initial_state.pt")
    assert set(restored) == set(saved)
    for name, tensor in saved.items():
        torch.testing.assert_close(restored[name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("target", in_the_suite(list(TARGETS), ["ddp", "fsdp_tp, tensor_parallel_size=1"]))
def test_a_tensor_parallel_checkpoint_resumes_under_another_layout_and_back(target, source, tmp_path):
    checkpoint = source.run_dir / "checkpoints" / "step000015.ckpt"
    name, *overrides = TARGETS[target]
    there = _continue(name, tuple(overrides), checkpoint, 18, tmp_path / "there")
    _assert_restored(there, checkpoint)
    assert sorted(there.losses) == [15, 16, 17]
    for step in (15, 16, 17):
        assert there.losses[step] == pytest.approx(source.losses[step], rel=1e-5), step

    back_from = there.run_dir / "checkpoints" / "step000017.ckpt"
    back = _continue("fsdp_tp", (), back_from, 19, tmp_path / "back")
    _assert_restored(back, back_from)
    assert sorted(back.losses) == [17, 18]
    for step in (17, 18):
        assert back.losses[step] == pytest.approx(source.losses[step], rel=1e-5), step


def test_a_damaged_or_mixed_tensor_parallel_shard_is_refused_naming_it(source, tmp_path):
    # What ckpt_path refuses and resume=true passes over (checkpoints/whole.py), for 2-D (dp x tp) shards: a flipped
    # byte in rank 1's, and, with the manifest gone, rank 1's shard of the other save.
    saved = source.run_dir / "checkpoints"
    damaged, mixed = tmp_path / "damaged" / "step000015.ckpt", tmp_path / "mixed" / "step000015.ckpt"
    for copy in (damaged, mixed):
        shutil.copytree(saved / "step000015.ckpt", copy)
    data = bytearray((damaged / "__1_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (damaged / "__1_0.distcp").write_bytes(bytes(data))
    (mixed / MANIFEST).unlink()
    shutil.copy(saved / "step000030.ckpt" / "__1_0.distcp", mixed / "__1_0.distcp")
    said = {}
    for checkpoint in (damaged, mixed):
        with pytest.raises(CheckpointError) as refused:
            check_whole(checkpoint)
        said[checkpoint] = str(refused.value)
    assert said[damaged].startswith(f"ckpt_path: {damaged} is damaged: {damaged / '__1_0.distcp'} does not match its"
                                    " checksum: its contents changed after the save"), said[damaged]
    assert said[mixed].startswith(f"ckpt_path: {mixed} is damaged: {mixed / '__1_0.distcp'} is of the save at step 30;"
                                  " the rest of the checkpoint is of the save at step 15"), said[mixed]
