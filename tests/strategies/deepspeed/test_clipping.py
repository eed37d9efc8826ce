"""Clipping under DeepSpeed is what the module asks for: `self.clip_gradients` in a manual-optimization step, a
`configure_gradient_clipping` hook, and, on resume, the resumed run's `gradient_clip_val`.

Lightning's DeepSpeed precision ignored `clip_gradients` (the first two updated by the raw gradient), and ZeRO-1/2
took the clipping norm of the checkpoint it resumed from (0.001 saved, 5.0 asked: it clipped at 0.001). With plain
SGD an update is -lr x the clipped gradient, so ||w1 - w0|| / lr is the norm that step clipped to.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist._compat.deepspeed import zero3_gathered

pytestmark = pytest.mark.slow

LR = 0.01


class Exploding(L.LightningModule):
    """A user's regressor whose loss is scaled so that its raw gradient norm is in the hundreds."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y) * 1000
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


class ManualClipOnFirstStep(Exploding):
    """Manual optimization as Lightning documents it: clip, then step; only the first step clips."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y) * 1000
        opt.zero_grad()
        self.manual_backward(loss)
        if batch_idx == 0:
            self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        opt.step()


class HookClipsAfterFirstStep(Exploding):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if self.global_step >= 1:
            self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")


class UpdateNorms(L.Callback):
    """||w_after - w_before|| / lr of each training step, over the whole (gathered) model."""

    def __init__(self):
        self.norms: list[float] = []

    def weights(self, module):
        parameters = list(module.parameters())
        with zero3_gathered(parameters):
            return torch.cat([p.detach().float().flatten().clone() for p in parameters])

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.before = self.weights(module)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.norms.append(float((self.weights(module) - self.before).norm()) / LR)


def fit(module, strategy, root, max_steps, ckpt_path=None, **trainer_options):
    torch.manual_seed(0)
    x = torch.randn(64, 16)
    data = DataLoader(TensorDataset(x, torch.sin(x.sum(dim=1, keepdim=True))), batch_size=8)
    norms = UpdateNorms()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, max_epochs=3, strategy=strategy, logger=False,
                        enable_model_summary=False, enable_progress_bar=False, default_root_dir=root,
                        callbacks=[norms], **trainer_options)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer, norms.norms


@pytest.mark.parametrize("strategy", ["ld_deepspeed_stage_2", "ld_deepspeed_stage_3"])
def test_clip_gradients_in_a_manual_step_clips_that_step_only(strategy, tmp_path, deepspeed_ops):
    _, norms = fit(ManualClipOnFirstStep(), strategy, tmp_path, max_steps=2)
    assert norms[0] == pytest.approx(1.0, abs=1e-3)
    assert norms[1] > 10  # not asked: the config's clipping (none)


def test_a_configure_gradient_clipping_hook_clips_at_its_own_norm(tmp_path, deepspeed_ops):
    _, norms = fit(HookClipsAfterFirstStep(), "ld_deepspeed_stage_2", tmp_path, max_steps=3)
    assert norms[0] > 10
    assert norms[1:] == pytest.approx([0.5, 0.5], abs=1e-3)


def test_a_resumed_run_clips_at_its_own_gradient_clip_val_not_the_checkpoints(tmp_path, deepspeed_ops):
    first, norms = fit(Exploding(), "ld_deepspeed_stage_2", tmp_path / "first", max_steps=2, gradient_clip_val=0.001)
    assert norms == pytest.approx([0.001, 0.001], abs=1e-5)
    checkpoint = first.checkpoint_callback.best_model_path
    _, norms = fit(Exploding(), "ld_deepspeed_stage_2", tmp_path / "second", max_steps=4, ckpt_path=checkpoint,
                   gradient_clip_val=5.0)
    assert norms == pytest.approx([5.0, 5.0], abs=1e-3)


def test_clipping_by_value_is_refused_in_one_line(tmp_path, deepspeed_ops):
    class ByValue(ManualClipOnFirstStep):
        def training_step(self, batch, batch_idx):
            self.clip_gradients(self.optimizers(), gradient_clip_val=1.0, gradient_clip_algorithm="value")

    with pytest.raises(ValueError, match=r"^clip_gradients\(gradient_clip_val=1.0, gradient_clip_algorithm='value'\): "
                                         r"DeepSpeed clips by the global norm only; pass gradient_clip_algorithm='norm'$"):
        fit(ByValue(), "ld_deepspeed_stage_2", tmp_path, max_steps=1)
