"""The plan against what running ranks hold, `plan=true` on the command line, and `strategy=auto_fit` training."""

from __future__ import annotations

import pytest

from lightning_dist.memory import GB, ModelFacts, layout_of, plan_memory
from lightning_dist.models.gpt import GPTLanguageModel
from lightning_dist.strategies.presets import PRESETS
from tests.conftest import run_train


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", "fsdp", "deepspeed_stage_2", "deepspeed_stage_3"])
def test_planned_model_state_is_within_15_percent_of_what_each_rank_holds(name, trained_runs):
    run = trained_runs(name)
    measured = [rank["cpu"] for rank in run.summary["model_state_bytes_per_rank"]]
    preset = PRESETS[name]
    plan = plan_memory(ModelFacts.of(GPTLanguageModel), layout_of(preset.strategy(**preset.kwargs), name), "32-true", devices=2)
    # What the ranks hold after a step is model state plus, under ZeRO-3, the gradient bucket allocated at start-up
    # (ZeRO-1/2 make theirs as backward starts and drop them after the step).
    planned = plan.model_state_per_device + (plan.device.get("gradient_bucket", 0) if name == "deepspeed_stage_3" else 0)
    print(f"{name}: planned {planned / 1e6:.2f} MB per rank, measured {[f'{m / 1e6:.2f}' for m in measured]} MB")
    for held in measured:
        assert abs(held - planned) / held < 0.15


def test_plan_prints_the_table_and_trains_nothing(tmp_path):
    run = run_train(tmp_path, "plan=true", "strategy=deepspeed_stage_3", "model=gpt_small")
    assert run.process.returncode == 0, run.output[-3000:]
    facts = ModelFacts.of(lambda: GPTLanguageModel(n_layer=6, d_model=512, n_head=8))
    assert "Memory plan: deepspeed_stage_3, 32-true, 2 ranks (2 per node)" in run.process.stdout
    # ZeRO-3 in fp32 over 2 ranks: (4 + 4 + 4 + 8) / 2 bytes per parameter, per category; the parameters under
    # its persistence threshold (1e5 elements) are also kept whole.
    persistent = sum(n for n in facts.parameter_sizes if n < 100_000)
    assert f"| per device | parameters | {facts.parameters * 2 / GB:.3f} |" in run.process.stdout
    assert f"| per device | persistent_parameters | {persistent * 4 / GB:.3f} |" in run.process.stdout
    assert f"| per device | optimizer_state | {facts.parameters * 6 / GB:.3f} |" in run.process.stdout
    assert f"All presets for {facts.parameters:,} parameters" in run.process.stdout
    assert sum(line.startswith("| ") for line in run.process.stdout.splitlines()) > len(PRESETS)
    assert not (tmp_path / "metrics.json").exists() and not (tmp_path / "checkpoints").exists()


def test_auto_fit_that_cannot_fit_is_one_line_before_anything_starts(tmp_path):
    run = run_train(tmp_path, "strategy=auto_fit", "strategy.device_memory_gb=0.001")
    assert run.process.returncode == 2
    (line,) = [each for each in run.process.stderr.splitlines() if each.startswith("error:")]
    assert line.startswith("error: strategy=auto_fit: nothing fits: ddp: needs 0.09 GB per device, 0.00 GB usable |")
    assert not (tmp_path / "metrics.json").exists()


@pytest.mark.slow
def test_auto_fit_trains_with_the_strategy_it_chose(tmp_path, deepspeed_ops):
    # 0.5 GB per device: ddp's plan (about 0.09 GB) fits.
    run = run_train(tmp_path, "strategy=auto_fit", "strategy.device_memory_gb=0.5", "trainer.max_steps=3", "test=false")
    assert run.process.returncode == 0, run.output[-3000:]
    assert "auto_fit: chose ddp: 0.09 GB per device of 0.42 GB usable" in run.output
    assert "on pydoc_text with ddp, 2 cpu ranks" in run.output and "with auto_fit" not in run.output  # the preset chosen
    assert run.summary["strategy"] == "DDPStrategy" and run.summary["global_step"] == 3


def test_the_preset_table_marks_the_presets_a_model_cannot_run_in_the_words_of_their_refusal():
    """`plan=true`'s table of every preset: a model with no tensor-parallel plan and no pipeline split (a user's
    regressor) is marked under the tensor-parallel and pipeline presets, each with the line its launch refuses it
    with; the bundled GPT, which has both, under none."""
    import torch

    from lightning_dist.run.preset_table import compare_presets
    from recipes.your_model.regressor import Regressor

    with torch.device("meta"):
        regressor, gpt = Regressor(), GPTLanguageModel()
    table = compare_presets(ModelFacts.of(Regressor), "32-true", 4, model=regressor)
    marked = [line.split(" | ")[0].removeprefix("| ") for line in table.splitlines() if "cannot run this model (below)" in line]
    assert marked == ["fsdp_tp", "hsdp_tp", "fsdp_pp", "fsdp_tp_pp"]
    said = [line for line in table.splitlines() if " cannot run this model: " in line]
    assert said[0] == ("fsdp_tp cannot run this model: strategy.tensor_parallel_size=2: Regressor has no tensor-parallel"
                       " plan (a `tp_plan` attribute); set strategy.tensor_parallel_plan (module-name patterns mapped to"
                       " colwise or rowwise), or split the model yourself in configure_model")
    assert said[2].startswith("fsdp_pp cannot run this model: strategy.pipeline_parallel_size: Regressor (the module"
                              " holding blocks) must define embed(*inputs) -> hidden and head(hidden) -> outputs")
    assert len(said) == 4
    assert "cannot run" not in compare_presets(ModelFacts.of(GPTLanguageModel), "32-true", 4, model=gpt)
