"""A damaged checkpoint of each format (a flipped byte in a shard, a deleted shard): `ckpt_path` refuses it in one
line naming the file, before any rank starts; `resume=true` passes over it for the older whole one and ends with the
weights of the run that was never damaged. A directory without its manifest whose shard is another save's is
refused too, naming both steps.

Each format's 30-step curve run (checkpoints at steps 15 and 30, and `last`) is copied; in the copy step 30 gets a
flipped byte and `last` loses a shard, so resuming must go back to step 15. These resumed runs are the step-15 resumes
of ddp, fsdp and ZeRO-2/3 that tests/strategies/test_equivalence.py leaves to this file.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from lightning_dist.checkpoints.formats import CheckpointError
from lightning_dist.checkpoints.manifest import MANIFEST
from lightning_dist.checkpoints.whole import check_whole
from lightning_dist.reports.equivalence import COMPARISON_OVERRIDES, read_train_losses
from tests.conftest import CURVE_OVERRIDES, in_the_suite, run_train

pytestmark = pytest.mark.slow

FORMATS = ["ddp", "fsdp", "deepspeed_stage_2", "deepspeed_stage_3"]  # a file, a DCP directory, ZeRO-2 and ZeRO-3 directories


def flip_a_byte_of_the_largest_file(checkpoint):
    """The file of `checkpoint` (itself, or its largest shard) with one byte in its middle inverted."""
    file = checkpoint if checkpoint.is_file() else max((p for p in checkpoint.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))
    return file


def delete_rank_1s_shard(checkpoint):
    """Rank 1's shard of a directory checkpoint (for DeepSpeed, its optimizer state); a file checkpoint whole."""
    file = checkpoint if checkpoint.is_file() else next(
        p for p in checkpoint.rglob("*") if p.name in ("__1_0.distcp", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    )
    file.unlink()
    return file


@pytest.mark.parametrize("name", in_the_suite(FORMATS, ["fsdp"]))  # a file, ZeRO-2's and ZeRO-3's: extended
def test_a_damaged_checkpoint_is_refused_by_ckpt_path_and_passed_over_by_resume(name, curve_runs, tmp_path):
    source = curve_runs(name)
    command = (f"strategy={name}", *COMPARISON_OVERRIDES, *CURVE_OVERRIDES)  # the curve run's, for resume=true to match
    earlier = tmp_path / "runs" / "earlier"
    shutil.copytree(source.run_dir, earlier)  # modification times kept: which checkpoint is newest stays as saved
    checkpoints = earlier / "checkpoints"
    flipped = flip_a_byte_of_the_largest_file(checkpoints / "step000030.ckpt")
    deleted = delete_rank_1s_shard(checkpoints / "last.ckpt")

    expected = {  # what the one line says of each: a file's zip record, or the directory's file, by name
        checkpoints / "step000030.ckpt": (f"{flipped} is damaged: its record " if name == "ddp" else f"is damaged: {flipped} ",
                                          " does not match its checksum: its contents changed after the save"),
        checkpoints / "last.ckpt": (f"no checkpoint at {deleted}",) if name == "ddp" else (f"is damaged: {deleted} is missing",),
    }
    for checkpoint, said in expected.items():
        refused = run_train(tmp_path / f"refused_{checkpoint.name}", *command, f"ckpt_path={checkpoint}")
        assert refused.process.returncode == 2, refused.output[-3000:]
        assert "Traceback" not in refused.output, refused.output[-3000:]
        (error,) = [line for line in refused.output.splitlines() if line.startswith("error:")]
        assert error.startswith("error: ckpt_path: ") and str(checkpoint) in error, error
        assert all(part in error for part in said), error

    resumed = run_train(tmp_path / "runs" / "resumed", *command, "resume=true")
    assert resumed.process.returncode == 0, resumed.output[-3000:]
    assert f"resume=true: resuming from {checkpoints / 'step000015.ckpt'}" in resumed.output
    assert "not resumable" not in resumed.output  # the data module restores the position: no false alarm
    losses, uninterrupted = read_train_losses(resumed.run_dir), source.losses
    assert sorted(losses) == list(range(15, 30))  # nothing re-trained, nothing skipped
    assert all(losses[step] == pytest.approx(uninterrupted[step], rel=1e-5) for step in losses), (losses, uninterrupted)
    final = torch.load(resumed.run_dir / "gathered_state.pt")
    expected_weights = torch.load(source.run_dir / "gathered_state.pt")
    assert set(final) == set(expected_weights)
    for key, tensor in expected_weights.items():
        torch.testing.assert_close(final[key], tensor, rtol=0, atol=1e-5, msg=key)


# Rank 1's file of step 15, in place of step 30's: the same shape and size. Without its manifest, a directory is
# held to the save its other files record: each shard of ours carries its save's id (checkpoints/save_id.py), each
# of DeepSpeed's per-rank files its step (ZeRO-3's model states the engine's, an optimizer partition its own count).
OTHER_SAVES_FILE = {
    "fsdp": "__1_0.distcp",
    "deepspeed_stage_2": "checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt",
    "deepspeed_stage_3": "checkpoint/zero_pp_rank_1_mp_rank_00_model_states.pt",
    "deepspeed_stage_3 optimizer": "checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt",
}


@pytest.mark.parametrize("case", list(OTHER_SAVES_FILE))
def test_a_shard_of_another_save_is_refused_without_the_manifest_naming_both_steps(case, curve_runs, tmp_path):
    saved = curve_runs(case.split()[0]).run_dir / "checkpoints"
    mixed = tmp_path / "step000030.ckpt"
    shutil.copytree(saved / "step000030.ckpt", mixed)
    (mixed / MANIFEST).unlink()
    check_whole(mixed)  # its own shards: whole
    other, replaced = saved / "step000015.ckpt" / OTHER_SAVES_FILE[case], mixed / OTHER_SAVES_FILE[case]
    if not replaced.name.endswith("model_states.pt"):  # ZeRO-3's model states also hold the step's pickled extras
        assert other.stat().st_size == replaced.stat().st_size
    shutil.copy(other, replaced)
    with pytest.raises(CheckpointError) as refused:
        check_whole(mixed)
    assert str(refused.value) == (
        f"ckpt_path: {mixed} is damaged: {replaced} is of the save at step 15; the rest of the checkpoint"
        " is of the save at step 30; pass another checkpoint, or resume=true to continue from the newest whole one")


def deepspeed_save(directory, engine_steps: int, optimizer_steps: list[int]):
    """A DeepSpeed checkpoint's pickles as ZeRO-2 lays them out: the model states, and rank r's optimizer partition
    whose Adam state has taken `optimizer_steps[r]` steps."""
    tag = directory / "checkpoint"
    tag.mkdir(parents=True)
    (directory / "latest").write_text("checkpoint")
    torch.save({"global_steps": engine_steps, "skipped_steps": 0, "dp_world_size": len(optimizer_steps)},
               tag / "mp_rank_00_model_states.pt")
    for rank, steps in enumerate(optimizer_steps):
        state = {0: {"step": torch.tensor(float(steps)), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}}
        torch.save({"optimizer_state_dict": {"base_optimizer_state": {"state": state, "param_groups": []}}},
                   tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return directory


def test_an_optimizer_ahead_of_the_engine_on_every_rank_is_one_save(tmp_path):
    # Resumed from another strategy's checkpoint at step 15, the optimizer counts on from 15 and DeepSpeed's engine
    # from 0: two steps later, every rank's optimizer has taken 17 steps, the engine 2. One save, not a mixed one.
    check_whole(deepspeed_save(tmp_path / "resumed", engine_steps=2, optimizer_steps=[17, 17]))
    mixed = deepspeed_save(tmp_path / "mixed", engine_steps=2, optimizer_steps=[17, 10])
    with pytest.raises(CheckpointError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt is of another save: its"
                       " optimizer has taken 10 steps, the other ranks' 17;"):
        check_whole(mixed)
