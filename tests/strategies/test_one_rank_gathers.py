"""A module's `self.all_gather` on one rank gathers without a collective (strategies/base.py), and returns what
Lightning's gather returns: the rank's tensor stacked, (1, ...), with a gradient only under `sync_grads`. On CPU a
gloo gather copies on gloo's worker thread, whose OpenMP team slows every later step of a 1-rank run
(BENCHMARKS.md, "One rank's steps after a sharded save": the same cause)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import TRAIN_ENV

USER_SCRIPT = '''
import sys
import lightning as L
import torch
import torch.distributed as dist
import lightning_dist  # noqa: F401  registers ld_ddp, ld_fsdp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

gathers = []
original = dist.all_gather
dist.all_gather = lambda *args, **kwargs: gathers.append(1) or original(*args, **kwargs)


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 3)])
        self.predictions = []

    def forward(self, x):
        return self.blocks[1](torch.relu(self.blocks[0](x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        if batch_idx == 0:  # a collective: every rank gathers, rank 0 says
            both = self.all_gather(loss, sync_grads=True), self.all_gather(loss)
            if self.trainer.is_global_zero:
                print("training", *[f"{tuple(t.shape)}:{t.requires_grad}" for t in both])
        return loss

    def validation_step(self, batch, batch_idx):
        self.predictions.append(self(batch[0]).argmax(-1))

    def on_validation_epoch_end(self):
        before, own = len(gathers), torch.cat(self.predictions)
        gathered = self.all_gather(own)
        self.predictions.clear()
        if self.trainer.is_global_zero:
            shape = "x".join(map(str, gathered.shape))
            print("validation", shape, torch.equal(gathered[0], own), "collectives", len(gathers) - before)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


L.seed_everything(0)
data = TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
trainer = L.Trainer(strategy=sys.argv[1], accelerator="cpu", devices=int(sys.argv[2]), max_steps=2, val_check_interval=2,
                    logger=False,
                    limit_val_batches=2, num_sanity_val_steps=0, enable_progress_bar=False, enable_checkpointing=False,
                    enable_model_summary=False)
trainer.fit(Classifier(), DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
'''


@pytest.mark.parametrize(("strategy", "devices"), [("ld_ddp", 1), ("ld_fsdp", 1), ("ld_ddp", 2)])
def test_self_all_gather_on_one_rank_is_the_ranks_tensor_stacked_without_a_collective(strategy, devices, tmp_path):
    script = tmp_path / "classifier.py"
    script.write_text(USER_SCRIPT)
    done = subprocess.run([sys.executable, str(script), strategy, str(devices)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, env=TRAIN_ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    # The loss (0-dim) gathered as (world size,); a gradient only with sync_grads, as Lightning's gather gives.
    assert f"training ({devices},):True ({devices},):False" in lines
    # 2 batches of 8 predictions a rank: rank 0's own first
    assert f"validation {devices}x16 True collectives {0 if devices == 1 else 1}" in lines
