"""A user's script that fine-tunes a module for 2 steps on CPU ranks, then 2 more: with a second `L.Trainer` (MODE
`new`: another stage of fine-tuning, as notebooks do), or with the same one (`same`: tested in between, then its
`max_steps` raised); then it saves a checkpoint and tests the module, and a new module from that checkpoint. Each
rank writes OUT_DIR/rank<N>.json: the losses its training steps computed, and the two test losses.

    PYTHONPATH=. python tests/two_trainers_script.py OUT_DIR ld_fsdp 2 new
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_dist  # noqa: F401  registers the ld_* names
from tests.tiny_llama import tiny_llama


class FineTune(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = tiny_llama()
        self.losses = []

    def training_step(self, batch, batch_idx):
        outputs = self.model(input_ids=batch[0], labels=batch[0])
        self.log("train_loss", outputs.loss)
        self.losses.append(outputs.loss.item())
        return outputs.loss

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.model(input_ids=batch[0], labels=batch[0]).loss, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


if __name__ == "__main__":
    out, strategy, devices, mode = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    tokens = torch.randint(0, 128, (16, 16), generator=torch.Generator().manual_seed(1))
    model = FineTune()

    def trainer_of_2_steps() -> L.Trainer:
        return L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)

    trainer = trainer_of_2_steps()
    trainer.fit(model, DataLoader(TensorDataset(tokens), batch_size=2))
    if mode == "new":
        trainer = trainer_of_2_steps()
    else:
        trainer.test(model, DataLoader(TensorDataset(tokens), batch_size=2))
        trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.fit(model, DataLoader(TensorDataset(tokens), batch_size=2))
    trainer.save_checkpoint(out / "fine-tuned.ckpt")
    tested = [trainer.test(module, DataLoader(TensorDataset(tokens), batch_size=2), ckpt_path=checkpoint)[0]["test_loss"]
              for module, checkpoint in ((model, None), (FineTune(), out / "fine-tuned.ckpt"))]
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"losses": model.losses, "tested": tested}))
