"""A DeepSpeed checkpoint resumes under DeepSpeed at another number of ranks (2 -> 1 and 1 -> 2), through
DeepSpeed's universal format: weights exact, Adam's moments carried, and the samples of an uninterrupted run."""

from __future__ import annotations

import pytest
import torch

from lightning_dist.checkpoints import load_consolidated
from lightning_dist.reports.equivalence import run_strategy
from tests.conftest import CURVE_OVERRIDES, in_the_suite

pytestmark = pytest.mark.slow

STAGES = ["deepspeed_stage_2", "deepspeed_stage_3"]
# One rank with twice the batch: the same global batch, and (positions being in samples) the same samples.
ONE_RANK = ("trainer.devices=1", "data.batch_size=32")


@pytest.fixture(scope="module")
def one_rank_runs(tmp_path_factory, deepspeed_ops):
    runs = {}

    def get(name: str):
        if name not in runs:
            runs[name] = run_strategy(name, [*CURVE_OVERRIDES, *ONE_RANK], tmp_path_factory.mktemp(f"{name}_1rank"))
            assert runs[name].returncode == 0
        return runs[name]

    return get


def step_15(run) -> str:
    return str(run.run_dir / "checkpoints" / "step000015.ckpt")


def weights(run, name="gathered_state.pt") -> dict[str, torch.Tensor]:
    state = torch.load(run.run_dir / name)
    del state["bytes_seen"]  # each rank's own count of its bytes: rank 0's half in a 2-rank run
    return state


def assert_same_weights(actual: dict, expected: dict, atol: float) -> None:
    assert set(actual) == set(expected)
    for key, tensor in expected.items():
        torch.testing.assert_close(actual[key], tensor, rtol=0, atol=atol, msg=key)


@pytest.mark.parametrize("name", in_the_suite(STAGES, ["deepspeed_stage_3"]))
def test_two_rank_checkpoint_resumes_on_one_rank(name, curve_runs, one_rank_runs, tmp_path):
    source, uninterrupted = curve_runs(name), one_rank_runs(name)
    resumed = run_strategy(name, [*CURVE_OVERRIDES, *ONE_RANK, f"ckpt_path={step_15(source)}"], tmp_path)
    assert resumed.returncode == 0
    saved = {k: v for k, v in load_consolidated(step_15(source))["state_dict"].items() if k != "bytes_seen"}
    assert_same_weights(weights(resumed, "initial_state.pt"), saved, atol=0)  # the gathered weights, exactly
    # The curve goes on as the 1-rank run's: its step-15 loss is of the same weights and samples.
    assert sorted(resumed.losses) == list(range(15, 30))
    for step in (15, 16, 17):
        assert resumed.losses[step] == pytest.approx(uninterrupted.losses[step], rel=1e-4), step
    # 15 more Adam steps land on the 2-rank run's own weights only with its moments, hyper-parameters and
    # samples (only the reduction order differs): a fresh Adam state, a weight decay on the wrong parameter
    # group or one other batch moves weights by 3e-4 or more (measured).
    assert_same_weights(weights(resumed), weights(source), atol=1e-5)


@pytest.mark.parametrize("name", in_the_suite(STAGES, []))
def test_one_rank_checkpoint_resumes_on_two_ranks(name, curve_runs, one_rank_runs, tmp_path):
    source, uninterrupted = one_rank_runs(name), curve_runs(name)
    resumed = run_strategy(name, [*CURVE_OVERRIDES, f"ckpt_path={step_15(source)}"], tmp_path)
    assert resumed.returncode == 0
    saved = {k: v for k, v in load_consolidated(step_15(source))["state_dict"].items() if k != "bytes_seen"}
    assert_same_weights(weights(resumed, "initial_state.pt"), saved, atol=0)
    assert sorted(resumed.losses) == list(range(15, 30))
    for step in (15, 16, 17):  # rank 0's half of the batch, in both
        assert resumed.losses[step] == pytest.approx(uninterrupted.losses[step], rel=1e-4), step
    assert_same_weights(weights(resumed), weights(source), atol=1e-5)  # as above: the run it resumed, continued
    # The conversion stays beside the checkpoint it came from; the saved tag is untouched.
    checkpoint = source.run_dir / "checkpoints" / "step000015.ckpt"
    assert (checkpoint / "latest").read_text().strip() == "checkpoint"
    assert (checkpoint / "latest_universal").read_text().strip() == "checkpoint_universal"
