"""A user's plain `DataLoader(shuffle=True, num_workers=2)` resumed under our strategies (tests/train_loader_script.py:
3 epochs of 9 batches a rank at 2 ranks, a warmup schedule over `estimated_stepping_batches`, checkpoints every 5 steps
and at each epoch's end) reads what the uninterrupted run read, batch for batch (data/train_loader_place.py):

- from the middle of an epoch, the rest of that epoch's order, not the epoch again from its first batch (Lightning's
  own behaviour, with its warning that the resume is unreliable); from a run stopped mid-epoch (max_steps, a
  callback's stop), the rest of the stopped epoch, not the next one (checkpoints saved as it stopped count it done);
  from an epoch's end under `max_steps`, the next epoch whole (Lightning trained a batch too many, #19617);
- from an epoch's end, the next epoch's order, not epoch 0's (Lightning #21938: with worker processes the iterator
  took its indices before the sampler's epoch was set);
- at another number of ranks, the samples of that epoch's order not read yet, in order, then whole epochs;
- where the loader was asked for before the checkpoint restored the loops (the schedule's step count, DeepSpeed's
  config), as where it was not; a `StatefulDataLoader` gets its saved state (Lightning #20550);
- from another engine's checkpoint, with the learning rates its warmup schedule had reached (checkpoints/resume.py);
- from a ZeRO-3 checkpoint of plain SGD (no optimizer state), under ddp and at another number of ranks.
  """

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO, TRAIN_ENV

pytestmark = pytest.mark.slow

UNRELIABLE = "dataloader is not resumable"


def run(out, strategy: str, devices: int, loader: str = "plain", ckpt_path=None,
        optimizer: str = "adamw", stop: str = "") -> tuple[list[dict], str]:
    """Each rank's steps ({global step: [epoch, batch_idx, sample numbers, loss]}) and the run's output.

    A run takes about 20 s. One that has not ended in 300 s is run once more: on CPython 3.11.7 (CI's) a loader's
    worker forked while another thread held the interpreter's thread-list lock can wait for it forever (CPython
    gh-112275: seen once, rank 1's first worker, in `PyOS_AfterFork_Child`); a hang of ours would hang again."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(REPO / "tests" / "train_loader_script.py"), str(out), strategy, str(devices),
               loader, optimizer, *([str(ckpt_path)] if ckpt_path else [])]
    env = {**TRAIN_ENV, "PYTHONPATH": str(REPO), "STOP": stop}
    try:
        process = subprocess.run(command, cwd=out, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        shutil.rmtree(out)  # what that run saved
        out.mkdir()
        process = subprocess.run(command, cwd=out, env=env, capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, process.stderr[-4000:]
    seen = [{int(step): row for step, row in json.loads((out / f"seen-{rank}.json").read_text()).items()}
            for rank in range(devices)]
    return seen, process.stdout + process.stderr


def samples(seen: list[dict], steps) -> list[list[list[int]]]:
    return [[rank_seen[step][2] for step in steps] for rank_seen in seen]


def losses(seen: list[dict], steps) -> list[float]:
    return [rank_seen[step][3] for rank_seen in seen for step in steps]


def epoch_order(seen: list[dict], epoch: int) -> list[int]:
    """The epoch's order over all ranks, as DistributedSampler deals it: batch by batch, each rank's i-th sample of
    a batch in turn."""
    steps = sorted(step for step, row in seen[0].items() if row[0] == epoch)
    return [number for step in steps for row in zip(*(rank_seen[step][2] for rank_seen in seen)) for number in row]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    seen, output = run(out, "ld_ddp", 2)
    assert [sorted(rank_seen) for rank_seen in seen] == [list(range(27))] * 2
    return seen, out / "checkpoints"


def test_a_resume_in_the_middle_of_an_epoch_goes_on_with_its_next_batch(uninterrupted, tmp_path):
    expected, checkpoints = uninterrupted
    seen, output = run(tmp_path, "ld_ddp", 2, ckpt_path=checkpoints / "epoch=1-step=10.ckpt")
    steps = range(10, 27)
    assert [sorted(rank_seen) for rank_seen in seen] == [list(steps)] * 2  # 17 steps: none read twice
    assert [[rank_seen[step][:2] for step in steps] for rank_seen in seen] == [
        [expected[0][step][:2] for step in steps]] * 2  # epoch 1 resumed at its batch 1
    assert samples(seen, steps) == samples(expected, steps)
    assert losses(seen, steps) == pytest.approx(losses(expected, steps), rel=1e-5)
    assert "Resumed in epoch 1 after 1 batches (8 samples): the train loader goes on with the next sample" in output
    assert UNRELIABLE not in output


@pytest.mark.parametrize("stop, strategy", [("max_steps:12", "ld_ddp"), ("callback:12", "ld_fsdp")])
def test_a_run_stopped_in_the_middle_of_an_epoch_finishes_it_when_continued(uninterrupted, tmp_path, stop, strategy):
    """Stopped after step 12 (epoch 1 after 3 of its 9 batches) by `max_steps` or by a callback (as Lightning's Timer
    stops at `max_time`), and continued to 3 epochs from the checkpoint saved as it stopped: epoch 1's last 6 batches,
    then epoch 2. Lightning counts the stopped epoch done and went on with epoch 2's order."""
    expected, _ = uninterrupted
    stopped, _ = run(tmp_path / "stopped", strategy, 2, stop=stop)
    assert [sorted(rank_seen) for rank_seen in stopped] == [list(range(12))] * 2
    seen, output = run(tmp_path / "continued", strategy, 2,
                       ckpt_path=tmp_path / "stopped" / "checkpoints" / "end-epoch=1.ckpt")
    steps = range(12, 27)
    assert [sorted(rank_seen) for rank_seen in seen] == [list(steps)] * 2
    assert [[rank_seen[step][:2] for step in steps] for rank_seen in seen] == [
        [expected[0][step][:2] for step in steps]] * 2  # epoch 1 from its batch 3
    assert samples(seen, steps) == samples(expected, steps)
    if stop.startswith("callback"):  # as the uninterrupted run's schedule (max_steps=12 fits it to 12 steps)
        assert losses(seen, steps) == pytest.approx(losses(expected, steps), rel=1e-5)
    assert "The checkpoint was saved as its run stopped in epoch 1 after 3 batches" in output
    assert UNRELIABLE not in output


def test_a_run_bounded_by_steps_resumed_at_an_epoch_s_end_reads_the_next_epoch_whole(uninterrupted, tmp_path):
    """Stopped by `max_steps=9` at epoch 0's end and resumed with `max_steps=27` from the checkpoint its epoch-end
    hooks saved: epochs 1 and 2 whole (18 steps). Lightning trained a batch 9 of the 9-batch epoch 0 first, then 9
    steps of epoch 1, and ended there, having counted an epoch too many (Lightning #19617)."""
    expected, _ = uninterrupted
    run(tmp_path / "stopped", "ld_ddp", 2, stop="max_steps:9")
    seen, output = run(tmp_path / "continued", "ld_ddp", 2, stop="max_steps:27",
                       ckpt_path=tmp_path / "stopped" / "checkpoints" / "end-epoch=0.ckpt")
    steps = range(9, 27)
    assert [sorted(rank_seen) for rank_seen in seen] == [list(steps)] * 2
    assert [[rank_seen[step][:2] for step in steps] for rank_seen in seen] == [
        [expected[0][step][:2] for step in steps]] * 2
    assert samples(seen, steps) == samples(expected, steps)


def test_a_resume_at_an_epoch_s_end_reads_the_next_epoch_s_order(uninterrupted, tmp_path):
    expected, checkpoints = uninterrupted
    seen, output = run(tmp_path, "ld_ddp", 2, ckpt_path=checkpoints / "end-epoch=0.ckpt")
    steps = range(9, 27)
    assert samples(seen, steps) == samples(expected, steps)
    assert samples(seen, [9]) != samples(expected, [0])  # epoch 0's first batch, which the old resume read again
    assert losses(seen, steps) == pytest.approx(losses(expected, steps), rel=1e-5)
    assert "Resumed" not in output


def test_a_resume_at_another_number_of_ranks_reads_the_samples_not_read_yet(uninterrupted, tmp_path):
    expected, checkpoints = uninterrupted
    (seen,), output = run(tmp_path, "ld_fsdp", 1, ckpt_path=checkpoints / "epoch=1-step=10.ckpt")
    resumed_epoch = [number for step in sorted(seen) if seen[step][0] == 1 for number in seen[step][2]]
    assert resumed_epoch == epoch_order(expected, 1)[8:]  # the 8 samples of its first batch were read before
    assert [seen[step][1] for step in sorted(seen) if seen[step][0] == 1] == list(range(1, 16))  # 58 samples: 15
    # The next epoch whole, in 17 batches of 1 rank: Lightning counted 16 for the resumed one, and asks again.
    assert [seen[step][1] for step in sorted(seen) if seen[step][0] == 2] == list(range(17))
    assert sorted(epoch_order([seen], 2)) == list(range(66))
    assert "Resumed in epoch 1 after 1 batches (8 samples)" in output and UNRELIABLE not in output
    assert ("The resumed epoch has 16 batches at this world size or batch size (8 samples a batch over the ranks when"
            " saved, 4 now): the train loader is asked for again at the next epoch's start") in output
    # Stopped again in that epoch (its step 15: 8 samples at 2 ranks, then 5 batches of 4) and resumed at 2 ranks.
    again, output = run(tmp_path / "again", "ld_fsdp", 2, ckpt_path=tmp_path / "checkpoints" / "epoch=1-step=15.ckpt")
    assert "Resumed in epoch 1 after 6 batches (28 samples)" in output
    assert epoch_order([{s: r for s, r in rank.items() if r[0] == 1} for rank in again], 1) == epoch_order(
        expected, 1)[28:]


@pytest.fixture(scope="module")
def zero3_resumed(uninterrupted, tmp_path_factory, deepspeed_ops):
    """ZeRO-3 resumed from the ddp run's step 10: DeepSpeed's config asks for the loader (the steps its schedule
    spans) before the checkpoint is restored; the ddp file is consolidated and partitioned into the engine."""
    out = tmp_path_factory.mktemp("zero3")
    seen, output = run(out, "ld_deepspeed_stage_3", 2, ckpt_path=uninterrupted[1] / "epoch=1-step=10.ckpt")
    return seen, output, out / "checkpoints"


def test_a_zero3_run_resumed_from_a_ddp_checkpoint_goes_on_with_the_next_batch(uninterrupted, zero3_resumed):
    expected, _ = uninterrupted
    seen, output, _ = zero3_resumed
    steps = range(10, 27)
    assert samples(seen, steps) == samples(expected, steps)
    # And at the learning rate the schedule had set: the first step after the resume ran at the warmup's 0 before.
    assert losses(seen, steps) == pytest.approx(losses(expected, steps), rel=1e-5)
    assert UNRELIABLE not in output


def test_a_ddp_run_resumed_from_a_zero3_checkpoint_keeps_the_schedule(uninterrupted, zero3_resumed, tmp_path):
    # A consolidated ZeRO-3 checkpoint: its schedule restarted from step 0 before (warming up again), and its
    # groups' learning rate was the new optimizer's.
    expected, _ = uninterrupted
    seen, _ = run(tmp_path, "ld_ddp", 2, ckpt_path=zero3_resumed[2] / "epoch=1-step=15.ckpt")
    steps = range(15, 27)
    assert samples(seen, steps) == samples(expected, steps)
    assert losses(seen, steps) == pytest.approx(losses(expected, steps), rel=1e-5)


def test_a_stateful_loader_gets_its_saved_place_where_it_was_asked_for_early(uninterrupted, tmp_path, deepspeed_ops):
    expected, _ = uninterrupted
    first, _ = run(tmp_path / "first", "ld_deepspeed_stage_2", 2, "stateful")
    assert samples(first, range(27)) == samples(expected, range(27))  # torchdata's sampler deals the same order
    seen, output = run(tmp_path / "resumed", "ld_deepspeed_stage_2", 2, "stateful",
                       tmp_path / "first" / "checkpoints" / "epoch=0-step=5.ckpt")
    steps = range(5, 27)
    assert samples(seen, steps) == samples(expected, steps)
    assert losses(seen, steps) == pytest.approx(losses(first, steps), rel=1e-5)
    assert UNRELIABLE not in output


@pytest.fixture(scope="module")
def zero3_sgd(tmp_path_factory, deepspeed_ops):
    out = tmp_path_factory.mktemp("zero3_sgd")
    seen, _ = run(out, "ld_deepspeed_stage_3", 2, optimizer="sgd")
    return seen, out / "checkpoints"


def test_a_zero3_checkpoint_of_plain_sgd_resumes_under_ddp(zero3_sgd, tmp_path):
    # Plain SGD keeps no state: its ZeRO-3 checkpoint's consolidation stopped on an empty merge (IndexError).
    expected, checkpoints = zero3_sgd
    seen, output = run(tmp_path, "ld_ddp", 2, ckpt_path=checkpoints / "epoch=1-step=10.ckpt", optimizer="sgd")
    steps = range(10, 27)
    assert samples(seen, steps) == samples(expected, steps)
    assert losses(seen, steps) == pytest.approx(losses(expected, steps), rel=1e-5)


def test_a_zero3_checkpoint_of_plain_sgd_resumes_at_another_number_of_ranks(zero3_sgd, tmp_path):
    # DeepSpeed's universal form holds Adam's moments only (its converter failed: `KeyError: 0`): the checkpoint is
    # consolidated and partitioned instead, and trains on as the same checkpoint does under ddp at 1 rank.
    _, checkpoints = zero3_sgd
    (seen,), output = run(tmp_path / "zero3", "ld_deepspeed_stage_3", 1,
                          ckpt_path=checkpoints / "epoch=1-step=10.ckpt", optimizer="sgd")
    assert "could not convert" not in output
    (under_ddp,), _ = run(tmp_path / "ddp", "ld_ddp", 1, ckpt_path=checkpoints / "epoch=1-step=10.ckpt",
                          optimizer="sgd")
    assert sorted(seen) == sorted(under_ddp) == list(range(10, 42))  # epoch 1's rest (batches 1-15), epoch 2 (17)
    assert losses([seen], sorted(seen)) == pytest.approx(losses([under_ddp], sorted(seen)), rel=1e-5)
