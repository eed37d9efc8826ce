"""`trainer.fit(model, ckpt_path=...)` from a user's own script, naming no checkpoint: refused on the launching
process with one line, before any rank starts (each rank failed reading it, after forming the process group, with a
traceback of its own)."""

from __future__ import annotations

import lightning as L
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_dist  # noqa: F401  (registers the ld_* strategies)
from lightning_dist.checkpoints.formats import CheckpointError, check_fit_ckpt_path
from lightning_dist.strategies.launcher import PreflightError


def test_a_mistyped_ckpt_path_is_refused_before_any_rank_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "epoch=1-step=13.ckpt").write_bytes(b"")
    trainer = L.Trainer(strategy="ld_ddp", accelerator="cpu", devices=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    # Lightning's launcher would start the other rank by running this process's command again: here, pytest.
    monkeypatch.setattr(trainer.strategy.launcher.launcher, "launch", lambda *args, **kwargs: pytest.fail("launched"))
    with pytest.raises(PreflightError) as refused:
        trainer.fit(BoringModel(), ckpt_path="checkpoints/epoch=1-step=12.ckpt")
    assert str(refused.value) == ("ckpt_path: no checkpoint at checkpoints/epoch=1-step=12.ckpt (expected a .ckpt file"
                                  " or checkpoint directory)")


@pytest.mark.parametrize("ckpt_path", [None, "last", "best", "hpc", "registry:my-model:latest", "s3://bucket/last.ckpt"])
def test_lightning_s_own_names_and_urls_are_left_to_lightning(ckpt_path):
    check_fit_ckpt_path(ckpt_path)


def test_a_directory_that_is_no_checkpoint_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"is a directory but not a checkpoint"):
        check_fit_ckpt_path(tmp_path)
