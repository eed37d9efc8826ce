"""A user's script that trains a transformers Llama's head, and its backbone from epoch 1, on 2 CPU ranks (SGD,
learning rate 0.5). HOW: `callback` (Lightning's `BackboneFinetuning` freezes the backbone and unfreezes it), `hook`
(frozen in `__init__`, unfrozen in the module's own `on_train_epoch_start`), or `lr0`, the reference: the backbone
trainable throughout, in a param group of its own at a learning rate of 0 until epoch 1 (Lightning #20340's
answer). Rank 0 writes OUT_DIR/losses.json: its training losses.

    PYTHONPATH=. python tests/unfreeze_script.py OUT_DIR ld_ddp callback
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import BackboneFinetuning
from torch.utils.data import DataLoader, TensorDataset

import lightning_dist  # noqa: F401  registers the ld_* names
from tests.tiny_llama import tiny_llama


class FineTune(L.LightningModule):
    def __init__(self, how: str):
        super().__init__()
        llama = tiny_llama()
        self.backbone, self.head = llama.model, llama.lm_head
        self.how = how
        if how == "hook":
            self.backbone.requires_grad_(False)
        self.losses = []

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        logits = self.head(self.backbone(input_ids=ids).last_hidden_state)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
        self.log("train_loss", loss)
        self.losses.append(loss.item())
        return loss

    def on_train_epoch_start(self):
        if self.current_epoch == 1 and self.how == "hook":
            self.backbone.requires_grad_(True)
        elif self.current_epoch == 1 and self.how == "lr0":
            self.trainer.optimizers[0].param_groups[1]["lr"] = 0.5

    def configure_optimizers(self):
        if self.how == "lr0":
            return torch.optim.SGD([{"params": self.head.parameters()},
                                    {"params": self.backbone.parameters(), "lr": 0.0}], lr=0.5)
        return torch.optim.SGD(self.parameters(), lr=0.5)


if __name__ == "__main__":
    out, strategy, how = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    tokens = torch.randint(0, 128, (16, 16), generator=torch.Generator().manual_seed(1))
    # The backbone's learning rate the head's from its epoch on: the reference's.
    callbacks = [BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.0,
                                    backbone_initial_ratio_lr=1.0, initial_denom_lr=1.0)] if how == "callback" else []
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks)
    model = FineTune(how)
    trainer.fit(model, DataLoader(TensorDataset(tokens), batch_size=2))
    if trainer.global_rank == 0:
        (out / "losses.json").write_text(json.dumps(model.losses))
