"""A Hugging Face-shaped model (layers in an nn.ModuleList, `_init_weights`, tied head) built in `configure_model`
trains under fsdp and ZeRO-3 with sharded initialisation: its own initialiser's weights, tied, the same under both
strategies (initialisation does not depend on how the model is sharded), and so the same losses."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, TRAIN_ENV

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory, deepspeed_ops) -> dict[str, dict]:
    runs = {}
    for strategy in ("ld_fsdp", "ld_deepspeed_stage_3"):
        out = tmp_path_factory.mktemp(strategy)
        process = subprocess.run([sys.executable, str(REPO / "tests" / "hf_style_script.py"), str(out), strategy],
                                 cwd=REPO, env={**TRAIN_ENV, "PYTHONPATH": str(REPO)}, capture_output=True,
                                 text=True, timeout=600)
        assert process.returncode == 0, process.stderr[-3000:]
        runs[strategy] = json.loads((out / "rank0.json").read_text())
    return runs


@pytest.mark.parametrize("strategy", ["ld_fsdp", "ld_deepspeed_stage_3"])
def test_sharded_init_applies_the_models_own_initialiser(hf_runs, strategy):
    run = hf_runs[strategy]
    assert run["built_on_meta"]
    assert run["linear_std"] == pytest.approx(0.02, rel=0.05)  # _init_weights, not torch's kaiming default
    assert run["layer_norm"] == [1.0, 0.0]
    assert run["tied"]


def test_fsdp_and_zero3_start_alike_and_train_alike(hf_runs):
    fsdp, zero3 = hf_runs["ld_fsdp"], hf_runs["ld_deepspeed_stage_3"]
    assert fsdp["checksum"] == zero3["checksum"]
    assert len(fsdp["losses"]) == len(zero3["losses"]) == 6
    for ours, theirs in zip(fsdp["losses"], zero3["losses"]):
        assert ours == pytest.approx(theirs, rel=1e-5)
    assert fsdp["losses"][-1] < fsdp["losses"][0]


def test_zero3_frees_gathered_weights_during_forward(hf_runs):
    # ZeRO-3's own linear (tests/strategies/deepspeed/test_zero3_runtime.py), as entering deepspeed.zero.Init would install it;
    # FSDP frees its unsharded storage itself and leaves torch's.
    assert hf_runs["ld_deepspeed_stage_3"]["linear"] == "zero3_linear_wrap"
    assert hf_runs["ld_fsdp"]["linear"] == "linear"
