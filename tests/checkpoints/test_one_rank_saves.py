"""A run of one rank saves and loads its sharded checkpoints as one process does, with no plan exchange over gloo.

torch.distributed.checkpoint gathers every rank's plan (gather_object, all_gather_object). On gloo, a gather larger
than ATen's grain size (32,768 bytes) copies in parallel on gloo's worker thread, and the OpenMP team it starts there,
beside the training's, puts libgomp over the machine's cores: it throttles its spin-wait, and every parallel op of
the training then waits on a sleeping worker. A 1-rank CPU run (2 intra-op threads) stepped 15% slower after its
first save on the default GPT, 60% on a deeper model, and as slow after a resume (docs/performance.md). The timing is
the benchmark's to show; this counts the gathers, at world size 1 and, for contrast, 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import TRAIN_ENV

USER_SCRIPT = '''
import sys
import traceback
import lightning as L
import torch
import torch.distributed as dist
import lightning_dist  # noqa: F401  registers ld_fsdp
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

gathers = []  # torch.distributed.checkpoint's (the package's own exchanges of a few bytes are not counted)
for name in ("gather_object", "all_gather_object", "all_gather", "all_gather_into_tensor"):
    def counted(*args, _original=getattr(dist, name), _name=name, **kwargs):
        if any("torch/distributed/checkpoint/" in frame.filename for frame in traceback.extract_stack()):
            gathers.append(_name)
        return _original(*args, **kwargs)
    setattr(dist, name, counted)


class Deep(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(24))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        for block in self.blocks:
            x = block(x)
        loss = x.square().mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(max_steps, ckpt_path=None):
    L.seed_everything(0)
    data = DataLoader(TensorDataset(torch.randn(64, 128)), batch_size=8)
    checkpoint = ModelCheckpoint(dirpath="checkpoints", save_last=True, every_n_train_steps=2, save_top_k=0)
    trainer = L.Trainer(strategy="ld_fsdp", accelerator="cpu", devices=int(sys.argv[1]), max_steps=max_steps,
                        logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[checkpoint])
    trainer.fit(Deep(), data, ckpt_path=ckpt_path)
    return trainer


fit(4)
saving = len(gathers)
trainer = fit(6, ckpt_path="checkpoints/last.ckpt")
if trainer.is_global_zero:
    print("steps", trainer.global_step, "saving", saving, "resuming", len(gathers) - saving)
'''


@pytest.mark.compat  # the load's swap of torch.distributed.checkpoint.load, on the oldest and the newest torch too
@pytest.mark.parametrize(("devices", "gathered"), [(1, False), (2, True)])
def test_sharded_saves_and_loads_gather_no_plans_on_one_rank(devices, gathered, tmp_path):
    script = tmp_path / "deep.py"
    script.write_text(USER_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(devices)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=TRAIN_ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    steps, saving, resuming = done.stdout.splitlines()[-1].split()[1::2]
    assert int(steps) == 6
    assert (tmp_path / "checkpoints" / "last.ckpt" / ".metadata").is_file()
    if gathered:  # DCP's plan exchange, in the saves (steps 2 and 4, then 6) and in the resume's load
        assert int(saving) > 0 and int(resuming) > 0
    else:
        assert (int(saving), int(resuming)) == (0, 0)
