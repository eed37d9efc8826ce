"""A user's own script: plain `L.Trainer`, no Hydra, modules that are not ours. Writes OUT_DIR/rank<N>.json.

    python tests/plain_trainer_script.py OUT_DIR ld_fsdp              # a registered name, Lightning's BoringModel
    python tests/plain_trainer_script.py OUT_DIR FSDPStrategy-ac      # a class instance: FSDP + activation checkpointing
    python tests/plain_trainer_script.py OUT_DIR ld_fsdp_activation_checkpointing encoder  # torch's TransformerEncoder
    python tests/plain_trainer_script.py OUT_DIR ds-config:PATH      # DeepSpeedStrategy(config=PATH)
    python tests/plain_trainer_script.py OUT_DIR ds-dict:PATH        # DeepSpeedStrategy(config=dict), betas etc. set
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_dist
from lightning_dist.parallel.placement import parameter_numel


class RecordingBoringModel(BoringModel):
    def training_step(self, batch, batch_idx):
        output = super().training_step(batch, batch_idx)
        self.losses = [*getattr(self, "losses", []), float(output["loss"])]
        return output


class EncoderModel(RecordingBoringModel):
    """BoringModel's task through torch's own nn.TransformerEncoder, whose layers sit in an nn.ModuleList."""

    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=2, dim_feedforward=64, batch_first=True)
        self.layer = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, num_layers=2), torch.nn.Linear(32, 2))

    def forward(self, x):
        return self.layer(x.unsqueeze(1)).squeeze(1)


def main(out_dir: str, choice: str, model_name: str = "boring") -> None:
    strategy = choice
    if choice == "FSDPStrategy-ac":
        strategy = lightning_dist.FSDPStrategy(activation_checkpointing=True, block_class=torch.nn.Linear)
    elif choice.startswith("ds-config:"):
        strategy = lightning_dist.DeepSpeedStrategy(config=choice.removeprefix("ds-config:"))
    elif choice.startswith("ds-dict:"):
        # BoringModel's optimizer is SGD: Adam's settings cannot be copied from it, so the dict names them.
        config = json.loads(Path(choice.removeprefix("ds-dict:")).read_text())
        config["optimizer"]["params"].update(betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0)
        strategy = lightning_dist.DeepSpeedStrategy(config=config)
    L.seed_everything(0)
    model = EncoderModel() if model_name == "encoder" else RecordingBoringModel()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=4, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model)
    local, total = parameter_numel(model)
    # One file per rank: both ranks share stdout, where their lines can interleave.
    (Path(out_dir) / f"rank{trainer.global_rank}.json").write_text(json.dumps({
        "rank": trainer.global_rank,
        "strategy": type(trainer.strategy).__name__,
        "backend": trainer.strategy._get_process_group_backend(),
        "global_step": trainer.global_step,
        "losses": model.losses,
        "parameters_local": local,
        "parameters_total": total,
        "deepspeed_config": getattr(trainer.strategy, "config", None) if choice.startswith("ds-") else None,
    }))


if __name__ == "__main__":
    main(*sys.argv[1:])
