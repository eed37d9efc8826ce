"""recipes/moe as its README types it, from one fresh working directory: the bundled mixture-of-experts GPT under
ZeRO-3, its experts' load in the run's metrics; a "pretrained" Mixtral written in the Hub's layout (each expert's
tensors apart), fine-tuned under fsdp from those weights with its routers' balancing loss, and exported."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from tests.conftest import REPO, documented_commands, run_documented

pytestmark = pytest.mark.slow

RECIPE = REPO / "recipes" / "moe" / "README.md"
STEPS = "trainer.max_steps=5"  # the first logged step (log_every_n_steps: 5): the monitor's expert load with it


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory, deepspeed_ops):
    """Every command of the page, in order, in one directory (recipes/ beside it, as in a clone's root)."""
    cwd = tmp_path_factory.mktemp("moe")
    (cwd / "recipes").symlink_to(REPO / "recipes")
    for command in documented_commands(RECIPE):
        typed = f"{command} {STEPS}" if command.startswith("python train.py") else command
        process = run_documented(typed, cwd)
        assert process.returncode == 0, f"{command}\n{process.stderr[-3000:]}"
    return cwd, sorted((cwd / "logs" / "train" / "runs").iterdir())


def test_each_command_ran_under_its_strategy(recipe_run):
    _, runs = recipe_run
    assert len(documented_commands(RECIPE)) == 4
    summaries = [json.loads((run / "metrics.json").read_text()) for run in runs]
    assert [s["strategy"] for s in summaries] == ["DeepSpeedStrategy", "FSDPStrategy"]
    assert [s["global_step"] for s in summaries] == [5, 5]


@pytest.mark.parametrize(("run", "first_layer", "most"), [(0, "blocks.0.moe", 8 / 2),
                                                         (1, "model.layers.0.mlp.gate", 4 / 2)],
                         ids=["gpt_moe", "mixtral"])
def test_each_run_logs_each_layer_s_expert_load(recipe_run, run, first_layer, most):
    """The GPT's layers count their tokens; transformers' routers are hooked to (8 experts and 4, 2 a token)."""
    _, runs = recipe_run
    with open(runs[run] / "csv" / "metrics.csv") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get(f"monitor/expert_load/{first_layer}")]
    loads = [float(value) for name, value in rows[0].items() if name.startswith("monitor/expert_load/") and value]
    assert len(rows) == 1 and len(loads) == 4  # at step 5, one for each of the 4 layers
    assert all(1.0 <= load <= most for load in loads)  # 1: even; experts / k: one expert took every token's choice


def test_mixtral_trained_from_the_folder_s_experts_and_exports_in_the_hub_s_layout(recipe_run):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    cwd = recipe_run[0]
    pretrained, exported = cwd / "pretrained" / "mixtral", cwd / "mixtral-tuned"
    keys = json.loads((exported / "model.safetensors.index.json").read_text())["weight_map"] \
        if (exported / "model.safetensors.index.json").exists() else None
    if keys is None:
        with safe_open(exported / "model.safetensors", "pt") as single:
            keys = list(single.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in keys  # written back as the Hub has it
    before = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32).state_dict()
    after = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).state_dict()
    assert sorted(before) == sorted(after)
    # 5 AdamW steps at lr 1e-3 move each weight by at most about 5e-3: each expert's fused weights are the
    # folder's, stacked in the experts' order (a fresh draw, or experts swapped, differs by tenths).
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.3.mlp.experts.down_proj",
                 "model.layers.0.mlp.gate.weight"):
        moved = (after[name] - before[name]).abs().max().item()
        assert 0 < moved < 6e-3, (name, moved)
