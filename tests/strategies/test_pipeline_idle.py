"""The idle clock's arithmetic, on a stand-in stage whose actions take known times: the share of each timed step
its actions leave idle, averaged over the steps since it was last asked for. Its comparison with the schedule's
share in a real 4-rank run is in tests/strategies/test_pipeline_parallel.py."""

from __future__ import annotations

import time

import pytest
import torch

from lightning_dist.strategies.torch.pipeline_idle import IdleClock


class Stage:
    def forward_one_chunk(self, seconds):
        time.sleep(seconds)
        return "output"

    def backward_one_chunk(self, seconds):
        time.sleep(seconds)

    def backward_weight_one_chunk(self, seconds):
        time.sleep(seconds)


def test_each_step_s_idle_share_is_what_its_actions_leave_and_a_read_starts_afresh():
    clock, stage = IdleClock(torch.device("cpu")), Stage()
    clock.watch(stage)
    assert clock.idle_share() is None
    with clock.step():  # busy 0.10 of 0.20 s
        assert stage.forward_one_chunk(0.04) == "output"
        stage.backward_one_chunk(0.06)
        time.sleep(0.10)
    with clock.step():  # busy 0.15 of 0.20 s: the weight pass counts as compute
        stage.backward_one_chunk(0.05)
        stage.backward_weight_one_chunk(0.10)
        time.sleep(0.05)
    assert clock.idle_share() == pytest.approx((0.5 + 0.25) / 2, abs=0.03)
    assert clock.idle_share() is None
    stage.forward_one_chunk(0.01)  # outside a step (a held-out pass): not timed, not kept
    assert clock.idle_share() is None


def test_a_stage_without_the_actions_it_times_is_refused_in_one_line():
    class Elsewhere:
        def forward_one_chunk(self):
            pass

    with pytest.raises(RuntimeError, match="PipelineStage has no backward_one_chunk"):
        IdleClock(torch.device("cpu")).watch(Elsewhere())
