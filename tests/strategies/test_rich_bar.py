"""Lightning's rich bar under our strategies, in a run bounded by max_steps (what `train.py` runs with
`callbacks.progress_bar=null`, and a plain script that leaves Lightning its default bar): the epoch has no total,
never "Epoch 0/-2"."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import RichProgressBar

from lightning_dist.data.pydoc_text import PydocTextDataModule
from lightning_dist.models.gpt import GPTLanguageModel

pytestmark = pytest.mark.slow


def fit_with_rich_bar(strategy: str, root) -> RichProgressBar:
    torch.manual_seed(0)
    bar = RichProgressBar()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, limit_val_batches=0, strategy=strategy, logger=False,
                        enable_checkpointing=False, enable_model_summary=False, default_root_dir=root, callbacks=[bar])
    trainer.fit(GPTLanguageModel(n_layer=1, d_model=32), datamodule=PydocTextDataModule(batch_size=2))
    return bar


def test_the_epoch_label_has_no_negative_total(tmp_path):
    ours = fit_with_rich_bar("ld_ddp", tmp_path / "ours")
    assert ours._get_train_description(0).strip() == "Epoch 0"
    # Lightning's own strategy, the same run: the label the fence's patch removes (if Lightning fixes it, this says so).
    lightnings = fit_with_rich_bar("auto", tmp_path / "lightning")
    assert lightnings._get_train_description(0).strip() == "Epoch 0/-2"
