"""A user's script that trains a transformers Llama's head first and its backbone from epoch 1, on 2 CPU ranks:
with Lightning's `BackboneFinetuning` (HOW `callback`), or in the module's own `on_train_epoch_start` (`hook`), as
Lightning's docs show both. Rank 0 writes OUT_DIR/losses.json: the training losses.

    PYTHONPATH=. python tests/unfreeze_script.py OUT_DIR ld_fsdp hook
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
    def __init__(self, unfreeze_in_hook: bool):
        super().__init__()
        llama = tiny_llama()
        self.backbone, self.head = llama.model, llama.lm_head
        self.unfreeze_in_hook = unfreeze_in_hook
        if unfreeze_in_hook:
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
        if self.unfreeze_in_hook and self.current_epoch == 1:
            self.backbone.requires_grad_(True)
            self.trainer.optimizers[0].add_param_group({"params": list(self.backbone.parameters()), "lr": 1e-3})

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


if __name__ == "__main__":
    out, strategy, how = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    tokens = torch.randint(0, 128, (16, 16), generator=torch.Generator().manual_seed(1))
    callbacks = [BackboneFinetuning(unfreeze_backbone_at_epoch=1)] if how == "callback" else []
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks)
    model = FineTune(unfreeze_in_hook=how == "hook")
    trainer.fit(model, DataLoader(TensorDataset(tokens), batch_size=2))
    if trainer.global_rank == 0:
        (out / "losses.json").write_text(json.dumps(model.losses))
