"""Lightning's `GradientAccumulationScheduler` under DeepSpeed is refused in one line before any rank starts; Lightning
refused it in every rank at the start of training, each with a traceback, once the engines were built."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent('''
    import lightning as L
    from lightning.pytorch.callbacks import GradientAccumulationScheduler
    from lightning.pytorch.demos.boring_classes import BoringModel

    import lightning_dist

    if __name__ == "__main__":
        trainer = L.Trainer(strategy="ld_deepspeed_stage_2", accelerator="cpu", devices=2, max_epochs=2, logger=False,
                            callbacks=[GradientAccumulationScheduler(scheduling={0: 4, 1: 2})])
        trainer.fit(BoringModel())
''')


def test_an_accumulation_schedule_under_deepspeed_is_refused_in_one_line_before_any_rank_starts(tmp_path):
    (tmp_path / "schedule.py").write_text(SCRIPT)
    process = subprocess.run([sys.executable, str(tmp_path / "schedule.py")], cwd=tmp_path,
                             env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert process.returncode == 1
    assert process.stderr.strip().splitlines()[-1] == (
        "lightning_dist.strategies.launcher.PreflightError: GradientAccumulationScheduler changes"
        " accumulate_grad_batches between epochs, which Lightning's DeepSpeed strategy refuses (DeepSpeed's batch sizes"
        " are fixed as its engine is built): set trainer.accumulate_grad_batches instead, or train under fsdp or ddp")
    assert "[rank" not in process.stderr
