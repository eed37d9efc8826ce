"""The template's `src/train.py`, cut to its core: compose the config, instantiate data, model and trainer
(`trainer:` names the strategy), fit, test.

    python recipes/lightning_hydra_template/train.py trainer=ld_fsdp
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
import lightning as L
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `recipes.` importable, as `src.` is in the template


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    L.seed_everything(cfg.seed, workers=True)
    datamodule = hydra.utils.instantiate(cfg.data)
    model = hydra.utils.instantiate(cfg.model)
    trainer: L.Trainer = hydra.utils.instantiate(cfg.trainer)
    trainer.fit(model=model, datamodule=datamodule)
    trainer.test(model=model, datamodule=datamodule)
    if trainer.is_global_zero:
        metrics = {name: round(float(value), 4) for name, value in trainer.callback_metrics.items()}
        print(f"Final metrics: {metrics}")


if __name__ == "__main__":
    main()
