"""A GPT with everything consolidation tends to lose: tied embeddings (inherited), a frozen parameter and a
buffer. At the end of training it writes the gathered weights, for tests to compare checkpoints against."""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch.distributed.tensor import DTensor

from lightning_dist.checkpoints import gather_full_state_dict
from lightning_dist.models.gpt import GPTLanguageModel


class CheckpointProbeGPT(GPTLanguageModel):
    """`loss_multiplier` > 1 makes the gradients explode, for clipping tests; the initial weights are saved too."""

    def __init__(self, gathered_path: str, loss_multiplier: float = 1.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.gathered_path = gathered_path
        self.loss_multiplier = loss_multiplier
        self.model.position_embedding.weight.requires_grad_(False)
        self.register_buffer("bytes_seen", torch.zeros(self.hparams.vocab_size))

    def training_step(self, batch, batch_idx):
        self.bytes_seen += torch.bincount(batch[0].flatten(), minlength=self.hparams.vocab_size).float()
        return super().training_step(batch, batch_idx) * self.loss_multiplier

    def on_train_start(self) -> None:
        # After a resume: what the checkpoint restored (weights, and Adam's state outside DeepSpeed).
        self._save_gathered(Path(self.gathered_path).with_name("initial_state.pt"))
        if not isinstance(self.trainer.strategy, DeepSpeedStrategy):
            # Read as it is: torch's get_optimizer_state_dict would initialise an empty state with a step of its own.
            names = {id(p): name for name, p in self.named_parameters()}
            state = {
                names[id(p)]: {k: (v.full_tensor() if isinstance(v, DTensor) else v).cpu() for k, v in sorted(s.items())}
                for p, s in self.trainer.optimizers[0].state.items()
            }
            if self.trainer.is_global_zero:
                torch.save(state, Path(self.gathered_path).with_name("initial_optimizer_state.pt"))

    def on_train_end(self) -> None:
        self._save_gathered(Path(self.gathered_path))

    def _save_gathered(self, path: Path) -> None:
        state = gather_full_state_dict(self)
        if self.trainer.is_global_zero:
            torch.save(state, path)
