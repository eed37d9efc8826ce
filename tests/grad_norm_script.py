"""A user's fine-tuning module that logs its gradients' norms the way Lightning's docs show it, with Lightning's own
`grad_norm` in `on_before_optimizer_step`, trained with a plain `L.Trainer` and a CSVLogger on CPU ranks. Lightning's
metrics.csv lands in OUT_DIR.

    PYTHONPATH=. python tests/grad_norm_script.py OUT_DIR ld_fsdp [DEVICES] [ACCUMULATE_GRAD_BATCHES]
"""

import sys

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import grad_norm
from torch.utils.data import DataLoader, TensorDataset

import lightning_dist  # noqa: F401  registers the ld_* names
from tests.tiny_llama import tiny_llama


class FineTune(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = tiny_llama()
        self.model.model.norm.weight.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        outputs = self.model(input_ids=batch[0], labels=batch[0])
        self.log("train_loss", outputs.loss)
        return outputs.loss

    def on_before_optimizer_step(self, optimizer):
        norms = grad_norm(self.model, norm_type=2)
        self.log_dict(norms)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


if __name__ == "__main__":
    out, strategy = sys.argv[1], sys.argv[2]
    devices = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    accumulate = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    tokens = torch.randint(0, 128, (16, 16), generator=torch.Generator().manual_seed(1))
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=2, log_every_n_steps=1,
                        accumulate_grad_batches=accumulate, logger=CSVLogger(out, name="", version=""),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(FineTune(), DataLoader(TensorDataset(tokens), batch_size=2))
