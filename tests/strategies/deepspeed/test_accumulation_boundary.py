"""Where a step's gradient accumulation ends under DeepSpeed: where Lightning (or the module) ends it, as under ddp.
tests/accumulation_script.py on 2 CPU ranks logs ddp's losses and steps.

- By hand (`manual`: two backwards a step, `self.clip_gradients`, its own scheduler step): DeepSpeed counted each
  backward as a step's end, and ZeRO-1/2 then kept the last backward's gradients only, or, offloaded, much less
  (after 8 steps the loss was 0.089, offloaded 0.44, where ddp's was 0.058).
- `accumulate_grad_batches=3` over 10 batches an epoch (`automatic`): Lightning steps at each epoch's last batch, 12
  steps in 3 epochs. DeepSpeed counted its own windows of 3 across the epochs' ends, and Lightning counted 9 steps
  (its scheduler and `max_steps` with them), with other losses, ZeRO-2's and ZeRO-3's unlike each other too.

Each `step()` now ends the accumulation (`managed_gradient_accumulation=false`), and Lightning decides when to step."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, in_the_suite

pytestmark = pytest.mark.slow

CASES = ["ld_deepspeed_stage_1", "ld_deepspeed_stage_2", "ld_deepspeed_stage_2_offload", "ld_deepspeed_stage_3"]


def run(strategy: str, mode: str, out_dir) -> list[dict]:
    process = subprocess.run([sys.executable, str(REPO / "tests" / "accumulation_script.py"), str(out_dir), strategy,
                              mode], cwd=out_dir, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                             timeout=600)
    assert process.returncode == 0, process.stderr[-4000:]
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    return {mode: run("ld_ddp", mode, tmp_path_factory.mktemp(mode)) for mode in ("manual", "automatic")}


@pytest.mark.parametrize("strategy", in_the_suite(CASES, ["ld_deepspeed_stage_1", "ld_deepspeed_stage_2_offload"]))
def test_a_manual_optimization_step_with_two_backwards_trains_as_under_ddp(strategy, tmp_path, ddp_runs, deepspeed_ops):
    for rank, reference in zip(run(strategy, "manual", tmp_path), ddp_runs["manual"]):
        assert rank["global_step"] == reference["global_step"] == 8
        assert rank["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("strategy", in_the_suite(CASES, ["ld_deepspeed_stage_2", "ld_deepspeed_stage_3"]))
def test_accumulation_steps_at_each_epochs_last_batch_as_under_ddp(strategy, tmp_path, ddp_runs, deepspeed_ops):
    for rank, reference in zip(run(strategy, "automatic", tmp_path), ddp_runs["automatic"]):
        assert rank["global_step"] == reference["global_step"] == 12
        assert rank["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)
