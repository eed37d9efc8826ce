"""`python train.py` tests the best checkpoint (by `callbacks.model_checkpoint.monitor`), as lightning-hydra-template
does, where it tested the final weights: a run of 10 steps whose best checkpoint is step 5's (mode=max on a falling
val_loss) tests what a run of 5 steps tests, to the bit, and that 5-step run tests its own weights without a load.
`train=false ckpt_path=...` (the template's eval.py) tests that checkpoint under another engine, to the bit."""

from __future__ import annotations

import pytest

from tests.conftest import in_the_suite, run_train

pytestmark = pytest.mark.slow

SHORT = ("trainer.devices=2", "trainer.max_steps=5", "trainer.val_check_interval=5", "trainer.num_sanity_val_steps=0")


# In the suite the sharded best checkpoint (a directory) tested under ddp; ddp's file tested under fsdp is an extended
# check (tests/checkpoints/test_cross_strategy_resume.py resumes ddp's file under ZeRO-3).
CASES = [("ddp", "fsdp"), ("fsdp", "ddp")]


@pytest.mark.parametrize(("strategy", "other"), in_the_suite(CASES, [("fsdp", "ddp")], unpack=True))
def test_test_runs_on_the_best_checkpoint_and_train_false_tests_a_given_one(strategy, other, tmp_path):
    longer = run_train(tmp_path / "longer", f"strategy={strategy}", *SHORT, "trainer.max_steps=10",
                       "callbacks.model_checkpoint.mode=max")
    short = run_train(tmp_path / "short", f"strategy={strategy}", *SHORT)
    best = tmp_path / "longer" / "checkpoints" / "step000005.ckpt"  # a directory of shards under fsdp
    tested = run_train(tmp_path / "tested", f"strategy={other}", "trainer.devices=2", "train=false",
                       f"ckpt_path={best}")
    for run in (longer, short, tested):
        assert run.process.returncode == 0, run.output[-3000:]
    assert longer.summary["best_checkpoint"].startswith(str(best))
    assert f"Tested the best checkpoint, {best}" in longer.process.stdout
    assert "Tested the final weights, the best checkpoint's" in short.process.stdout
    assert longer.val_losses()[9] < longer.val_losses()[4]  # steps 10 and 5 (logged as 9 and 4): 10 was not tested
    assert longer.summary["metrics"]["test_loss"] == short.summary["metrics"]["test_loss"]
    assert f"Tested the checkpoint {best}" in tested.process.stdout
    assert tested.summary["metrics"] == {name: short.summary["metrics"][name] for name in ("test_loss", "test_ppl")}
    assert not (tmp_path / "tested" / "checkpoints").exists()  # nothing trained, nothing saved
