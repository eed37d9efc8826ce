"""docs/configuration.md's `python train.py -m hparams_search=optuna` at tiny size: 4 Optuna trials, each a 2-rank
ddp job in its own process, the best val_loss and parameters reported, and the study's best the best trial's
metrics.json."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.conftest import REPO, documented, run_documented

pytestmark = pytest.mark.slow

SEARCH = documented(REPO / "docs" / "configuration.md", "python train.py -m hparams_search=optuna")
TINY = " trainer.max_steps=3 test=false"  # each trial 3 steps: the search is what is tested, not the training


@pytest.fixture(scope="module")
def search(tmp_path_factory, deepspeed_ops):
    cwd = tmp_path_factory.mktemp("optuna")
    process = run_documented(SEARCH + TINY, cwd)
    assert process.returncode == 0, process.stderr[-4000:]
    (sweep_dir,) = (cwd / "logs" / "train" / "multiruns").iterdir()
    return process, sweep_dir


def test_four_trials_of_two_rank_ddp_each_in_its_own_job(search):
    _, sweep_dir = search
    trials = sorted(p for p in sweep_dir.iterdir() if p.is_dir())
    assert [p.name for p in trials] == ["0", "1", "2", "3"]
    for trial in trials:
        summary = json.loads((trial / "metrics.json").read_text())
        assert (summary["strategy"], summary["world_size"], summary["global_step"]) == ("DDPStrategy", 2, 3)
        overrides = yaml.safe_load((trial / ".hydra" / "overrides.yaml").read_text())
        assert {o.split("=")[0] for o in overrides} >= {"model.optimizer.lr", "model.optimizer.weight_decay"}


def test_the_best_value_and_parameters_are_the_best_trials(search):
    process, sweep_dir = search
    results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    trials = {}
    for trial in (p for p in sweep_dir.iterdir() if p.is_dir()):
        overrides = dict(o.split("=", 1) for o in yaml.safe_load((trial / ".hydra" / "overrides.yaml").read_text()))
        trials[float(overrides["model.optimizer.lr"])] = json.loads((trial / "metrics.json").read_text())["metrics"]["val_loss"]
    assert results["best_value"] == pytest.approx(min(trials.values()), rel=1e-6)
    assert trials[results["best_params"]["model.optimizer.lr"]] == pytest.approx(results["best_value"], rel=1e-6)
    assert 0.0 <= results["best_params"]["model.optimizer.weight_decay"] <= 0.1
    assert f"Best value: {results['best_value']}" in process.stdout + process.stderr
