"""Kill -9 of every rank at random moments during saves, again and again, then `resume=true`: the run always
resumes from a complete checkpoint and ends with the weights of a run that was never interrupted."""

from __future__ import annotations

import pytest
import torch

from scripts.fault_loop import train_through_kills
from tests.conftest import in_the_suite

pytestmark = pytest.mark.slow


# The two directory formats, whose saves take long enough for kills to cut them off midway (DDP's 10 MB file is
# written in a few ms, and replaced atomically). Any preset, 20 kills: `python -m scripts.fault_loop --strategy ddp`.
# With checkpoint.async=true the kill lands in a background write while training goes on (the suite kills FSDP's
# saves so; its synchronous ones and ZeRO-2's in scripts/extended_checks.sh).
LOOPS = [("fsdp", ()), ("deepspeed_stage_2", ()), ("fsdp", ("checkpoint.async=true",))]


@pytest.mark.parametrize(("name", "overrides"), in_the_suite(LOOPS, LOOPS[2:], unpack=True),
                         ids=["fsdp", "deepspeed_stage_2", "fsdp checkpoint.async=true"])
def test_kill_9_during_saves_then_resume_ends_with_the_uninterrupted_weights(name, overrides, curve_runs, tmp_path):
    loop = train_through_kills(name, tmp_path, kills=5, seed=sum(map(ord, name)), overrides=overrides)
    assert len(loop.kills) == 5, loop.kills
    assert any(".partial" in kill for kill in loop.kills), loop.kills  # at least one cut a write off midway
    assert loop.returncode == 0, (tmp_path / loop.final_run.name).with_suffix(".log").read_text()[-3000:]
    # The finishing attempt resumed (it did not start over): from a complete checkpoint of an earlier attempt.
    log = (tmp_path / f"{loop.final_run.name}.log").read_text()
    assert "resume=true: resuming from" in log and ".partial" not in log.split("resume=true: resuming from")[1].splitlines()[0]
    final = torch.load(loop.final_run / "gathered_state.pt")
    uninterrupted = torch.load(curve_runs(name).run_dir / "gathered_state.pt")  # the same 30 steps, never killed
    assert set(final) == set(uninterrupted)
    for key, tensor in uninterrupted.items():
        torch.testing.assert_close(final[key], tensor, rtol=0, atol=1e-5, msg=key)
