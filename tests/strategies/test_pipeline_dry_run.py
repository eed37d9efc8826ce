"""The dry run of pipeline stages, as docs/strategies.md types it: a 70B-class GPT in 8 stages x 8 data-parallel
ranks (64 ranks, CUDA faked), each rank's stages stepped in the order its schedule (1F1B, Interleaved1F1B) runs them,
beside the plan: each rank's peak within 15% of the plan's, the receive buffers the plan's to 1%, and the stage's
gradients accumulated whole (torch's schedules reduce them once per step) as the plan counts them."""

from __future__ import annotations

import pytest

from tests.conftest import REPO, documented_commands, in_the_suite, run_documented
from tests.test_dry_run import rows

pytestmark = pytest.mark.slow

PAGE = REPO / "docs" / "strategies.md"
TARGET_70B = ("python train.py --config-dir recipes/choose_a_strategy/conf model=gpt_70b dry_run=true trainer=gpu"
              " trainer.devices=8 trainer.num_nodes={nodes} strategy=fsdp_pp strategy.pipeline_parallel_size=8")
SCHEDULES = {"1F1B": "", "Interleaved1F1B": " strategy.pipeline_schedule=Interleaved1F1B strategy.stages_per_rank=2"}


def dry_run(nodes: int, schedule: str):
    command = TARGET_70B.format(nodes=nodes) + SCHEDULES[schedule]
    assert command in documented_commands(PAGE)  # the whole command, as typed there
    run = run_documented(command, REPO, timeout=600)  # from where the recipe's --config-dir is
    assert run.returncode == 0, run.stderr[-3000:]
    return run


# The suite dry-runs the default schedule's; Interleaved1F1B's (two stages a rank) runs in the extended matrix.
@pytest.mark.parametrize("schedule", in_the_suite(list(SCHEDULES), ["1F1B"]))
def test_a_pipelined_70b_gpt_at_64_ranks_peaks_within_15_percent_of_its_plan(schedule):
    run = dry_run(8, schedule)
    assert "Dry run: fsdp_pp, bf16-mixed, 64 ranks (8 per node) on fake CUDA devices" in run.stdout
    assert "rank 0: pipeline_parallel=0, data_parallel=0" in run.stdout
    assert "rank 63: pipeline_parallel=7, data_parallel=7" in run.stdout
    table = rows(run.stdout)
    # Rank 0 holds the first stage: the embeddings and the first 10 (1F1B) or 5 (interleaved) blocks, sharded 8 ways.
    assert table["model.token_embedding.weight"][1] == "[32, 8192]"  # 256 bytes x 8192, over 8 data-parallel ranks
    assert "model.blocks.0.attn.q.weight" in table and "model.blocks.10.attn.q.weight" not in table
    rank_0, rank_63, plan = (float(v) for v in table["peak"])
    for peak in (rank_0, rank_63):
        assert abs(peak - plan) / plan < 0.15, (peak, plan)
    for static in ("optimizer state", "pipeline receive buffers"):
        measured, _, planned = (float(v) for v in table[static])
        assert abs(measured - planned) <= 0.01 * planned, static
    # The stage's gradients, accumulated whole in fp32 until the step's end: 8.05e9 parameters x 4 bytes.
    accumulated, _, planned = (float(v) for v in table["temporaries (gradients accumulated whole)"])
    assert 32.0 < planned < 32.5 and abs(accumulated - planned) / planned < 0.1


@pytest.mark.extended  # a third 70B dry run; the 64-rank ones are the suite's
def test_a_pipelined_70b_gpt_dry_runs_at_1024_ranks():
    run = dry_run(128, "1F1B")
    assert "rank 1023: pipeline_parallel=7, data_parallel=127" in run.stdout
    rank_0, rank_1023, plan = (float(v) for v in rows(run.stdout)["peak"])
    assert abs(rank_0 - plan) / plan < 0.15 and abs(rank_1023 - plan) / plan < 0.15
