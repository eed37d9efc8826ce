"""A user's LoRA fine-tune whose checkpoints leave the frozen base out, as Lightning users write it under DeepSpeed:
`DeepSpeedStrategy(stage=..., exclude_frozen_parameters=True)` (or ours under FSDP and DDP), the pretrained folder
loaded in `configure_model` and PEFT's `get_peft_model` on it, a step that passes `labels=` and logs `.loss`, AdamW
over `self.parameters()`, and a checkpoint every 2 steps. Writes OUT_DIR/losses-<rank>.json: {global step: loss} of
the steps it ran.

    python tests/lora_checkpoint_script.py OUT_DIR FOLDER STAGE DEVICES MAX_STEPS true|false [CKPT_PATH]

STAGE is DeepSpeed's ZeRO stage (1, 2 or 3), `fsdp` or `ddp` (our strategies of those names, given the option), or a
registered strategy's name as it is (`ld_fsdp`: the option is then ignored).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM

import lightning_dist


class LoraFineTune(L.LightningModule):
    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder
        self.model = None
        self.losses: dict[int, float] = {}

    def configure_model(self):
        if self.model is None:
            base = AutoModelForCausalLM.from_pretrained(self.folder)
            self.model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss)
        self.losses[self.global_step + 1] = loss.item()
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main(out_dir: str, folder: str, stage: str, devices: str, max_steps: str, exclude: str,
         ckpt_path: str | None = None) -> None:
    L.seed_everything(0)
    out = Path(out_dir)
    tokens = torch.randint(0, 100, (48, 16), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(tokens), batch_size=2)
    option = {"exclude_frozen_parameters": exclude == "true"}
    strategies = {"fsdp": lightning_dist.FSDPStrategy, "ddp": lightning_dist.DDPStrategy}
    if stage.startswith("ld_"):
        strategy = stage
    elif stage in strategies:
        strategy = strategies[stage](**option)
    else:
        strategy = lightning_dist.DeepSpeedStrategy(stage=int(stage), **option)
    trainer = L.Trainer(
        accelerator="cpu", devices=int(devices), strategy=strategy, max_steps=int(max_steps), logger=False,
        enable_progress_bar=False, default_root_dir=out,
        callbacks=[ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=2, save_top_k=-1)],
    )
    model = LoraFineTune(folder)
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    (out / f"losses-{trainer.global_rank}.json").write_text(json.dumps(model.losses))


if __name__ == "__main__":
    main(*sys.argv[1:])
