"""Two DeepSpeed runs in one interpreter, the process group closed between them as `train()` closes it (a notebook's
next cell, a sweep's next job in its launcher's process): the second builds its own groups. DeepSpeed cached the
first run's, and ZeRO-3 failed on them with "Group ... is not registered" (found by CI, when a plain-Lightning
ZeRO-2 run in one test module preceded the in-process ZeRO-3 runs of tests/parallel/test_device_discipline.py)."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_dist.data.pydoc_text import PydocTextDataModule
from lightning_dist.lifecycle.process_exit import close_process_group
from lightning_dist.models.gpt import GPTLanguageModel

pytestmark = pytest.mark.slow


def fit(strategy: str, root) -> L.Trainer:
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, limit_val_batches=0, strategy=strategy,
                        logger=False, enable_checkpointing=False, enable_model_summary=False,
                        enable_progress_bar=False, default_root_dir=root)
    trainer.fit(GPTLanguageModel(n_layer=2, d_model=64), datamodule=PydocTextDataModule(batch_size=4))
    return trainer


def test_a_second_deepspeed_run_after_the_process_group_closed_builds_its_own_groups(tmp_path, deepspeed_ops):
    first = fit("ld_deepspeed_stage_2", tmp_path / "first")
    close_process_group()
    second = fit("ld_deepspeed_stage_3", tmp_path / "second")
    close_process_group()
    assert (first.global_step, second.global_step) == (2, 2)
    assert 4.0 < float(second.callback_metrics["train_loss"]) < 6.0  # a real loss: ln(256) = 5.5 before training
