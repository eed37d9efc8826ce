"""A user's own train loader resumed in the middle of an epoch (tests/stateful_loader_script.py): with torchdata's
`StatefulDataLoader` and `StatefulDistributedSampler` Lightning saves its position in the checkpoint, and every
engine's checkpoint keeps it, so the run stopped at step 4 of a 16-step epoch and resumed from `last` reads the
uninterrupted run's batches and gives its losses at steps 4-7. (A plain DataLoader restarts the epoch's data from its
first batch, as Lightning warns: docs/checkpoints.md.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, TRAIN_ENV, in_the_suite

pytestmark = pytest.mark.slow


def run(out, strategy: str, steps: int, *ckpt_path: str) -> dict[str, list]:
    process = subprocess.run([sys.executable, str(REPO / "tests" / "stateful_loader_script.py"), str(out), strategy,
                              str(steps), *ckpt_path], cwd=out, env={**TRAIN_ENV, "PYTHONPATH": str(REPO)},
                             capture_output=True, text=True, timeout=600)
    assert process.returncode == 0, process.stderr[-4000:]
    assert "dataloader is not resumable" not in process.stderr
    return json.loads((out / f"losses-{steps}-0.json").read_text())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, list]:
    return run(tmp_path_factory.mktemp("uninterrupted"), "ld_ddp", 8)


# ZeRO-3's checkpoint keeps the loader's place in the extended checks; in the suite, tests/checkpoints/
# test_train_loader_place.py resumes ZeRO-3 checkpoints mid-epoch with the next batch.
@pytest.mark.parametrize("strategy", in_the_suite(["ld_fsdp", "ld_deepspeed_stage_3"], ["ld_fsdp"]))
def test_a_resume_mid_epoch_goes_on_with_the_next_batch(strategy, uninterrupted, tmp_path, deepspeed_ops):
    first = run(tmp_path, strategy, 4)
    resumed = run(tmp_path, strategy, 8, "last")
    assert sorted(first) == ["0", "1", "2", "3"] and sorted(resumed) == ["4", "5", "6", "7"]
    run_in_two = {**first, **resumed}
    assert {step: samples for step, (_, samples) in run_in_two.items()} == {
        step: samples for step, (_, samples) in uninterrupted.items()}
    assert [loss for loss, _ in run_in_two.values()] == pytest.approx([loss for loss, _ in uninterrupted.values()],
                                                                     rel=1e-5)
