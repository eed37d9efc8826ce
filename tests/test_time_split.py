"""benchmarks/time_split.py: a rank's profiled steps split into Python, operators, the autograd engine and
collectives, from the cProfile files `benchmarks.timing.StepCProfile` writes on every rank."""

from __future__ import annotations

import cProfile
import pstats

import lightning as L
from lightning.pytorch.demos.boring_classes import BoringModel

from benchmarks.time_split import bucket, own_time_gap, rank_file, split
from benchmarks.timing import PROFILED_STEPS, StepCProfile


def test_each_function_falls_in_one_bucket_by_what_cprofile_names_it():
    assert bucket(("~", 0, "<method 'wait' of 'torch._C._distributed_c10d.Work' objects>")) == "collectives"
    assert bucket(("~", 0, "<built-in method batch_isend_irecv of PyCapsule object>")) == "other C"
    assert bucket(("~", 0, "<method 'run_backward' of 'torch._C._EngineBase' objects>")) == "autograd engine"
    assert bucket(("~", 0, "<built-in method torch.mm>")) == "operators"
    assert bucket(("~", 0, "<method 'add_' of 'torch._C.TensorBase' objects>")) == "operators"
    assert bucket(("/x/pipeline.py", 12, "run")) == "Python"


def test_the_callback_profiles_the_same_steps_on_each_rank_and_the_split_reads_them(tmp_path):
    class Module(BoringModel):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx)

    trainer = L.Trainer(max_steps=PROFILED_STEPS.stop + 1, callbacks=[StepCProfile(str(tmp_path / "ours.prof"))],
                        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module())
    seconds, python = split(rank_file(tmp_path / "ours.prof", 0))
    assert all(seconds[name] > 0 for name in ("Python", "operators", "autograd engine"))
    assert seconds["collectives"] == 0  # one process: none
    # The step's own function, called once for each profiled step, and no other.
    stats = pstats.Stats(str(rank_file(tmp_path / "ours.prof", 0))).stats
    calls = {key[2]: value[1] for key, value in stats.items() if key[0] == __file__}
    assert calls == {"training_step": len(PROFILED_STEPS)}
    assert any(name.endswith("(training_step)") for _, name in python)


def _squares(n: int) -> int:
    return sum(i * i for i in range(n))


def _only_ours() -> int:
    total = 0
    for i in range(300_000):  # in its own frame: cProfile's own time of this function
        total += i * i
    return total


def test_the_gap_names_the_functions_ours_spends_its_extra_time_in(tmp_path):
    for side, calls in (("ours", [_squares, _only_ours]), ("raw", [_squares])):
        profile = cProfile.Profile()
        profile.enable()
        for call in calls:
            call(100_000) if call is _squares else call()
        profile.disable()
        profile.dump_stats(tmp_path / f"{side}.prof")
    gaps = own_time_gap(tmp_path / "ours.prof", tmp_path / "raw.prof", top=3)
    assert gaps[0][1].endswith("(_only_ours)") and gaps[0][0] > 0.005, gaps
    assert all(gap >= later for (gap, _), (later, _) in zip(gaps, gaps[1:]))
