"""FSDP2's warning that a sharded module returned a view (torch 2.13 on, once per rank) is replaced by the check of
what it warns about: a language model whose head has a bias (its 3-D output is a view of the 2-D matmul) trains
under `ld_fsdp` with no such line; the same model dividing its logits in place in `training_step` stops, saying
which module and what to write instead."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import TRAIN_ENV

pytestmark = pytest.mark.slow

USER_SCRIPT = '''
import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dist  # noqa: F401


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


class TinyLM(L.LightningModule):
    def __init__(self, scale_in_place=False):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(Block(32) for _ in range(2))
        self.head = nn.Linear(32, 64)
        self.scale_in_place = scale_in_place

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        logits = self(tokens)
        if self.scale_in_place:
            logits /= 2.0
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


if __name__ == "__main__":
    L.seed_everything(0)
    tokens = torch.randint(0, 64, (64, 16))
    data = DataLoader(TensorDataset(tokens, tokens.roll(-1, dims=1)), batch_size=8)
    trainer = L.Trainer(strategy="ld_fsdp", accelerator="cpu", devices=2, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(TinyLM(scale_in_place=sys.argv[1:] == ["in_place"]), data)
    if trainer.is_global_zero:
        print("trained", trainer.global_step)
'''


def run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "tiny_lm.py"
    script.write_text(USER_SCRIPT)
    return subprocess.run([sys.executable, str(script), *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=TRAIN_ENV)


def test_a_head_returning_a_view_trains_without_fsdps_warning(tmp_path):
    done = run(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "trained 3"
    assert "view tensor" not in done.stdout + done.stderr


def test_its_output_changed_in_place_stops_the_run_naming_the_module_and_the_fix(tmp_path):
    done = run(tmp_path, "in_place")
    assert done.returncode != 0
    assert ("RuntimeError: the output of the FSDP-sharded TinyLM was changed in place in the training step (an op"
            " like `x += y` or `x.div_(t)` on it): FSDP2 then skips gathering its parameters for backward and its"
            " gradients can be wrong; write it out of place (`x = x + y`), or `.clone()` the output first") in done.stderr
    assert "trained" not in done.stdout
