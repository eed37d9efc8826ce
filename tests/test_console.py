"""What `python train.py` prints (issue 16): each line a person needs once, no library noise before the progress
bar. Read from the acceptance runs of ddp and ZeRO-3 (2 ranks each), as a user's console shows them."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", ["ddp", "deepspeed_stage_3"])
def test_each_line_once_and_no_library_noise(trained_runs, name):
    run = trained_runs(name)
    assert run.process.returncode == 0, run.output[-3000:]
    output = run.output
    assert output.count(f"Training gpt_tiny (0.84M parameters) on pydoc_text with {name}, 2 cpu ranks, 32-true; "
                        f"outputs in {run.run_dir}") == 1
    assert output.count("Seed set to 42") == 1 and "[rank: 1]" not in output
    assert output.count("nitializing") == 1  # Lightning's "Initializing distributed" (DeepSpeed: "initializing deepspeed ...")
    for noise in ("Instantiating", "LeafSpec", "💡", "is deprecated", "compilers.C"):
        assert noise not in output, noise
