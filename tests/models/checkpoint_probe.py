"""A GPT with everything consolidation tends to lose: tied embeddings (inherited), a frozen parameter and a
buffer. At the end of training it writes the gathered weights, for tests to compare checkpoints against."""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_dist.checkpoints import gather_full_state_dict
from lightning_dist.models.gpt import GPTLanguageModel


class CheckpointProbeGPT(GPTLanguageModel):
    def __init__(self, gathered_path: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.gathered_path = gathered_path
        self.model.position_embedding.weight.requires_grad_(False)
        self.register_buffer("bytes_seen", torch.zeros(self.hparams.vocab_size))

    def training_step(self, batch, batch_idx):
        self.bytes_seen += torch.bincount(batch[0].flatten(), minlength=self.hparams.vocab_size).float()
        return super().training_step(batch, batch_idx)

    def on_train_end(self) -> None:
        state = gather_full_state_dict(self)
        if self.trainer.is_global_zero:
            torch.save(state, Path(self.gathered_path))
