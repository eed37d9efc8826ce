"""recipes/bring_your_ds_config: a Hugging Face ds_config used unchanged, what its "auto" values became, and a
contradiction refused before launch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lightning_dist.reports.equivalence import run_strategy
from recipes.bring_your_ds_config.show_auto import main as show_auto
from tests.conftest import HF_ZERO2, REPO


@pytest.mark.slow
def test_hf_zero2_file_trains_and_its_autos_are_shown(tmp_path, deepspeed_ops, capsys):
    run = run_strategy("deepspeed", [f"strategy.config={HF_ZERO2}", "trainer.max_steps=3"], tmp_path / "run")
    assert run.returncode == 0 and sorted(run.losses) == [0, 1, 2]
    assert show_auto([str(HF_ZERO2), str(run.run_dir / "deepspeed_config.effective.json")]) == 0
    table = {line.split()[0]: line.split("auto -> ")[1] for line in capsys.readouterr().out.splitlines()}
    assert table == {
        "fp16.enabled": "false", "bf16.enabled": "false",
        "optimizer.params.lr": "0.001", "optimizer.params.betas": "[0.9, 0.95]", "optimizer.params.eps": "1e-08",
        "optimizer.params.weight_decay": "0.01",
        "scheduler.params.warmup_min_lr": "0.0", "scheduler.params.warmup_max_lr": "0.001",
        "scheduler.params.warmup_num_steps": "1",
        "gradient_accumulation_steps": "1", "gradient_clipping": "0.0",
        "train_batch_size": "32", "train_micro_batch_size_per_gpu": "16",
    }


def test_a_preset_that_contradicts_the_file_is_refused_in_one_line():
    command = [sys.executable, str(REPO / "train.py"), "strategy=deepspeed_stage_3", f"strategy.config={HF_ZERO2}"]
    process = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    assert process.returncode == 2
    assert process.stderr.strip().splitlines()[-1] == (
        "error: strategy.config (transformers_ds_config_zero2.json): 1 problem: zero_optimization.stage=2 but"
        " strategy.stage=3 (make them agree)"
    )
