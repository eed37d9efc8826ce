"""A user's script that fine-tunes with Lightning's `EMAWeightAveraging` (or `StochasticWeightAveraging`: CALLBACK
`swa`), validating and saving a checkpoint every 2 steps on 2 CPU ranks, then tests the model and each checkpoint,
tests the last checkpoint in a Trainer without the callback, and resumes a second fit from the first checkpoint.
Rank 0 writes OUT_DIR/result.json: the validation losses (the average's, which the callback swaps in), the test
losses (the model as the callback leaves it: the average; each checkpoint, whose own weights the callback restores
beside the average; the last checkpoint's `state_dict` alone: the average) and the resumed fit's.
STRATEGY `ld_fsdp_one_file`: ld_fsdp gathering each checkpoint into one file. After CALLBACK, `compiled`: the module
compiles its transformers model (`torch.compile`, the eager backend: the same numbers); `resume=A,B`: the second fit
resumes under strategy A, and another under B ("resumed under B"), instead of under STRATEGY.

    PYTHONPATH=. python tests/weight_averaging_script.py OUT_DIR ld_ddp ema [compiled] [resume=ld_fsdp]
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, EMAWeightAveraging, ModelCheckpoint, StochasticWeightAveraging
from torch.utils.data import DataLoader, TensorDataset

import lightning_dist  # noqa: F401  registers the ld_* names
from lightning_dist.strategies.fsdp import FSDPStrategy
from tests.tiny_llama import tiny_llama

TOKENS = torch.randint(0, 128, (16, 16), generator=torch.Generator().manual_seed(1))


COMPILED = "compiled" in sys.argv[4:]
RESUMED_UNDER = next((arg.removeprefix("resume=").split(",") for arg in sys.argv[4:] if arg.startswith("resume=")),
                     sys.argv[2:3])


class FineTune(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = torch.compile(tiny_llama(), backend="eager") if COMPILED else tiny_llama()

    def training_step(self, batch, batch_idx):
        outputs = self.model(input_ids=batch[0], labels=batch[0])
        self.log("train_loss", outputs.loss)
        return outputs.loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(input_ids=batch[0], labels=batch[0]).loss, sync_dist=True)

    def test_step(self, batch, batch_idx):
        outputs = self.model(input_ids=batch[0], labels=batch[0])
        self.log("test_loss", outputs.loss, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class ValidationLosses(Callback):
    def __init__(self):
        self.losses = []

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.losses.append(trainer.callback_metrics["val_loss"].item())


def loader(tokens):
    return DataLoader(TensorDataset(tokens), batch_size=2)


def strategy_of(name):
    return FSDPStrategy(save_distributed_checkpoint=False) if name == "ld_fsdp_one_file" else name


def fit(out, strategy, callback, ckpt_path=None):
    averaging = EMAWeightAveraging(decay=0.9) if callback == "ema" else StochasticWeightAveraging(swa_lrs=1e-3)
    validated = ValidationLosses()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy_of(strategy), max_steps=4, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
                        val_check_interval=2, num_sanity_val_steps=0,
                        callbacks=[averaging, validated,
                                   ModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=-1)])
    model = FineTune()
    trainer.fit(model, loader(TOKENS), loader(TOKENS[8:]), ckpt_path=ckpt_path)
    return trainer, model, validated.losses


if __name__ == "__main__":
    out, strategy, callback = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    trainer, model, validated = fit(out, strategy, callback)
    tested = {"validated": validated, "model": trainer.test(model, loader(TOKENS[:8]))[0]["test_loss"]}
    for step in (2, 4):
        checkpoint = next(out.glob(f"*step={step}.ckpt"))
        tested[f"step {step}"] = trainer.test(FineTune(), loader(TOKENS[:8]), ckpt_path=checkpoint)[0]["test_loss"]
    alone = L.Trainer(accelerator="cpu", devices=2, strategy=strategy_of(strategy), logger=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=out / "alone")
    tested["step 4 alone"] = alone.test(FineTune(), loader(TOKENS[:8]),
                                        ckpt_path=next(out.glob("*step=4.ckpt")))[0]["test_loss"]
    for index, under in enumerate(RESUMED_UNDER):
        resumed, model, validated = fit(out / f"resumed_{under}", under, callback,
                                        ckpt_path=next(out.glob("*step=2.ckpt")))
        tested["resumed" if index == 0 else f"resumed under {under}"] = {
            "validated": validated, "model": resumed.test(model, loader(TOKENS[:8]))[0]["test_loss"]}
    if trainer.global_rank == 0:
        (out / "result.json").write_text(json.dumps(tested))
