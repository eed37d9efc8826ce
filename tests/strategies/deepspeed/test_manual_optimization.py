"""A manual-optimization module (tests/manual_optimization_script.py: two backwards a step, `self.clip_gradients`,
its own scheduler step) logs ddp's losses under DeepSpeed on 2 CPU ranks.

DeepSpeed counted each backward as a step's end (its `gradient_accumulation_steps` is 1 under manual optimization),
and ZeRO-1/2 then kept the last backward's gradients only, or, offloaded, much less: after 8 steps the loss was
0.089 (ZeRO-1/2) and 0.44 (ZeRO-2 offloaded) where ddp's was 0.058. Under manual optimization our strategy has each
`step()` end the accumulation (`managed_gradient_accumulation=false`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, in_the_suite

pytestmark = pytest.mark.slow

CASES = ["ld_deepspeed_stage_1", "ld_deepspeed_stage_2", "ld_deepspeed_stage_2_offload", "ld_deepspeed_stage_3"]


def run(strategy: str, out_dir) -> list[dict]:
    process = subprocess.run([sys.executable, str(REPO / "tests" / "manual_optimization_script.py"), str(out_dir), strategy],
                             cwd=out_dir, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                             timeout=600)
    assert process.returncode == 0, process.stderr[-4000:]
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def ddp_losses(tmp_path_factory):
    return run("ld_ddp", tmp_path_factory.mktemp("ddp"))


@pytest.mark.parametrize("strategy", in_the_suite(CASES, ["ld_deepspeed_stage_1", "ld_deepspeed_stage_2_offload"]))
def test_a_manual_optimization_step_with_two_backwards_trains_as_under_ddp(strategy, tmp_path, ddp_losses, deepspeed_ops):
    ranks = run(strategy, tmp_path)
    for rank, reference in zip(ranks, ddp_losses):
        assert rank["global_step"] == reference["global_step"] == 8
        assert rank["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)
