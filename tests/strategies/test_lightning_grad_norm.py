"""Lightning's own `grad_norm`, as its docs show it (`self.log_dict(grad_norm(self.model, norm_type=2))` in
`on_before_optimizer_step`), logs under each engine of ours the norms Lightning's ddp logs. Before: under ld_fsdp
it stopped the run (`RuntimeError: The tensor has a non-zero number of elements, but its data is not allocated yet`,
DTensor shards in `torch.tensor`), under ZeRO-1 to 3 it logged nothing and said nothing (the engine holds the
gradients; `p.grad` is None), and under pipeline stages rank 0's logger wrote the first stage's norms and its part
of the total. tests/grad_norm_script.py is the user's module; metrics.csv is what its CSVLogger wrote."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities import grad_norm as imported_before_any_run

from lightning_dist._compat import lightning as lightning_compat
from lightning_dist.parallel.parameter_grad_norms import grad_norm
from tests.conftest import REPO, TRAIN_ENV

SCRIPT = REPO / "tests" / "grad_norm_script.py"
# Lightning's DDP is the reference: Lightning's grad_norm as Lightning runs it.
RUNS = {"reference": ("ddp", 2, 1), "ld_fsdp": ("ld_fsdp", 2, 1), "ld_deepspeed_stage_2": ("ld_deepspeed_stage_2", 2, 1),
        "ld_deepspeed_stage_3": ("ld_deepspeed_stage_3", 2, 1), "reference_1_rank": ("ddp", 1, 1),
        "ld_fsdp_pp": ("ld_fsdp_pp", 2, 1)}


def _run(out: Path, strategy: str, devices: int, accumulate: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(out), strategy, str(devices), str(accumulate)], cwd=REPO,
                          env={**TRAIN_ENV, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600)


def _logged_norms(out: Path) -> list[dict[str, float]]:
    with open(out / "metrics.csv") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("grad_2.0_norm_total")]
    return [{name: float(value) for name, value in row.items() if name.startswith("grad_") and value} for row in rows]


@pytest.fixture(scope="module")
def logged(tmp_path_factory, deepspeed_ops) -> dict[str, list[dict[str, float]]]:
    norms = {}
    for name, (strategy, devices, accumulate) in RUNS.items():
        out = tmp_path_factory.mktemp(name)
        process = _run(out, strategy, devices, accumulate)
        assert process.returncode == 0, process.stderr[-3000:]
        norms[name] = _logged_norms(out)
    return norms


def test_the_reference_logs_each_trainable_parameter_and_the_total(logged):
    rows = logged["reference"]
    assert len(rows) == 2  # one per optimizer step
    names = set(rows[0])
    assert "grad_2.0_norm/model.layers.1.mlp.down_proj.weight" in names
    assert "grad_2.0_norm/model.norm.weight" not in names  # frozen by the user: no gradient
    assert len(names) == 21  # 20 trainable parameters and the total
    assert rows[0]["grad_2.0_norm_total"] > 0


@pytest.mark.parametrize("strategy", ["ld_fsdp", "ld_deepspeed_stage_2", "ld_deepspeed_stage_3"])
def test_each_engine_logs_the_norms_ddp_logs(logged, strategy):
    reference, ours = logged["reference"], logged[strategy]
    assert len(ours) == len(reference)
    for theirs, mine in zip(reference, ours):
        assert set(mine) == set(theirs)
        for name, value in theirs.items():
            assert mine[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name


def test_pipeline_stages_log_every_stages_norms_on_rank_0(logged):
    # Two stages at 2 ranks: one data-parallel replica, as ddp at 1 rank.
    reference, ours = logged["reference_1_rank"], logged["ld_fsdp_pp"]
    assert len(ours) == len(reference) == 2
    for theirs, mine in zip(reference, ours):
        assert set(mine) == set(theirs)  # the last stage's parameters too, logged by rank 0 of the first
        for name, value in theirs.items():
            assert mine[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name


def test_zero2_accumulating_stops_in_one_line_instead_of_logging_unreduced_norms(tmp_path, deepspeed_ops):
    # Lightning ends each accumulation at the step, where ZeRO-1/2 reduce: no rank holds a whole gradient before.
    process = _run(tmp_path, "ld_deepspeed_stage_2", 2, 2)
    assert process.returncode != 0
    assert ("RuntimeError: grad_norm: under ZeRO-2 with accumulate_grad_batches > 1 or manual optimization, DeepSpeed "
            "reduces the gradients inside its step") in process.stderr


def test_the_swap_reaches_a_name_imported_before_it_and_is_undone():
    module = torch.nn.Linear(3, 2)
    module(torch.ones(4, 3)).sum().backward()
    lightning_own = imported_before_any_run(module, 2)
    lightning_compat.lightning_grad_norm_runs(grad_norm)
    try:
        assert imported_before_any_run.__code__ is lightning_compat._runs_the_replacement.__code__
        ours = imported_before_any_run(module, 2)
        assert list(ours) == list(lightning_own)  # the same keys in the same order
        for name, value in lightning_own.items():
            assert float(ours[name]) == pytest.approx(float(value), rel=1e-6)
    finally:
        lightning_compat.lightning_grad_norm_runs(None)
    assert imported_before_any_run.__code__ is lightning_compat._LIGHTNING_GRAD_NORM
    assert float(imported_before_any_run(module, 2)["grad_2.0_norm_total"]) == float(lightning_own["grad_2.0_norm_total"])


def test_a_lightning_grad_norm_taking_other_arguments_is_not_swapped(monkeypatch):
    def grad_norm(module, norm_type, group_separator="/", foreach=True):  # a Lightning to come
        return {}

    monkeypatch.setattr(lightning_compat, "_LIGHTNING_GRAD_NORM", grad_norm.__code__)
    with pytest.raises(RuntimeError, match=r"grad_norm\('module', 'norm_type', 'group_separator', 'foreach'\)"):
        lightning_compat.lightning_grad_norm_runs(grad_norm)
    assert imported_before_any_run.__code__ is not lightning_compat._runs_the_replacement.__code__
