"""A user's script that trains, tests and saves a final checkpoint with a plain `L.Trainer` on 2 CPU ranks, in the
order MODE gives (`fit,test,save` or `fit,save,test`; `hf`: transformers' own `save_pretrained` on rank 0), then
tests that checkpoint. Rank 0 writes OUT_DIR/result.json:
the test losses, in memory and from the checkpoint.

    PYTHONPATH=. python tests/save_after_test_script.py OUT_DIR ld_deepspeed_stage_3 fit,save,test
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

    def training_step(self, batch, batch_idx):
        outputs = self.model(input_ids=batch[0], labels=batch[0])
        self.log("train_loss", outputs.loss)
        return outputs.loss

    def test_step(self, batch, batch_idx):
        outputs = self.model(input_ids=batch[0], labels=batch[0])
        self.log("test_loss", outputs.loss, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


if __name__ == "__main__":
    out, strategy, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
    tokens = torch.randint(0, 128, (16, 16), generator=torch.Generator().manual_seed(1))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)
    model = FineTune()
    tested = []
    for step in mode:
        if step == "fit":
            trainer.fit(model, DataLoader(TensorDataset(tokens), batch_size=2))
        elif step == "test":
            tested += trainer.test(model, DataLoader(TensorDataset(tokens), batch_size=2))
        elif step == "hf":  # transformers' own, on rank 0, as its docs and most notebooks write it
            if trainer.is_global_zero:
                model.model.save_pretrained(out / "fine-tuned")
        else:
            trainer.save_checkpoint(out / "final.ckpt")
    tested += trainer.test(model, DataLoader(TensorDataset(tokens), batch_size=2), ckpt_path=out / "final.ckpt")
    if trainer.global_rank == 0:
        (out / "result.json").write_text(json.dumps([result["test_loss"] for result in tested]))
