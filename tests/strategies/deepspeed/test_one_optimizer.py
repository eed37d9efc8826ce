"""A GAN (two optimizers, manual optimization, as Lightning's docs write one) under DeepSpeed is refused in one line
before any rank starts. DeepSpeed's engine steps one optimizer: Lightning refused it only in each rank, after they
started, each with a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

GAN_SCRIPT = textwrap.dedent('''
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_dist


    class GAN(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.generator = nn.Linear(8, 16)
            self.discriminator = nn.Linear(16, 1)

        def training_step(self, batch, batch_idx):
            g_opt, d_opt = self.optimizers()
            fake = self.generator(torch.randn(batch[0].shape[0], 8))
            g_loss = self.discriminator(fake).mean()
            g_opt.zero_grad()
            self.manual_backward(g_loss)
            g_opt.step()
            d_loss = self.discriminator(fake.detach()).mean() - self.discriminator(batch[0]).mean()
            d_opt.zero_grad()
            self.manual_backward(d_loss)
            d_opt.step()

        def configure_optimizers(self):
            return [torch.optim.Adam(self.generator.parameters()), torch.optim.SGD(self.discriminator.parameters())]


    if __name__ == "__main__":
        trainer = L.Trainer(strategy="ld_deepspeed_stage_2", accelerator="cpu", devices=2, max_steps=2, logger=False)
        trainer.fit(GAN(), DataLoader(TensorDataset(torch.randn(64, 16)), batch_size=8))
''')


def test_two_optimizers_under_deepspeed_are_refused_in_one_line_before_any_rank_starts(tmp_path):
    script = tmp_path / "gan.py"
    script.write_text(GAN_SCRIPT)
    process = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
                             capture_output=True, text=True, timeout=300)
    assert process.returncode == 1
    assert process.stderr.strip().splitlines()[-1] == (
        "lightning_dist.strategies.launcher.PreflightError: configure_optimizers returns 2 optimizers (Adam, SGD): "
        "DeepSpeed's engine steps one; train this module under fsdp or ddp, or give one optimizer its parameter groups"
    )
    assert "[rank1]" not in process.stderr and "MisconfigurationException" not in process.stderr
