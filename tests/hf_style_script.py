"""A Hugging Face-shaped causal LM in a user's LightningModule, built in `configure_model`, trained with a plain
`L.Trainer` on 2 CPU ranks. Writes OUT_DIR/rank<N>.json: losses, and the initial weights' statistics.

    python tests/hf_style_script.py OUT_DIR ld_fsdp
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

import lightning_dist  # noqa: F401  registers the ld_* names
from lightning_dist.checkpoints import gather_full_state_dict


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        causal = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class CausalLM(nn.Module):
    """transformers' layout: embeddings, `layers` in an nn.ModuleList, a tied head, `_init_weights` + `post_init`."""

    def __init__(self, vocab: int = 256, hidden: int = 64, layers: int = 3, initializer_range: float = 0.02) -> None:
        super().__init__()
        self.initializer_range = initializer_range
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=self.initializer_range)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=self.initializer_range)
        elif isinstance(module, nn.LayerNorm):
            module.bias.data.zero_()
            module.weight.data.fill_(1.0)

    def post_init(self) -> None:
        self.apply(self._init_weights)
        self.lm_head.weight = self.embed_tokens.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


class FineTune(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model: CausalLM | None = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is None:
            self.model = CausalLM()

    def training_step(self, batch, batch_idx):
        tokens = batch[0]
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        self.losses.append(float(loss))
        return loss

    def on_train_start(self) -> None:
        self.initial = gather_full_state_dict(self)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main(out_dir: str, strategy: str) -> None:
    L.seed_everything(0)
    # Counting sequences from random starts: next token = this one + 1, learnable in a few steps.
    starts = torch.randint(0, 256, (64, 1), generator=torch.Generator().manual_seed(1))
    tokens = (starts + torch.arange(17)) % 256
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=4)
    module = FineTune()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=6, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)
    initial = module.initial
    summary = {
        "losses": module.losses,
        "built_on_meta": getattr(trainer.strategy, "initializes_shards", False),
        "linear_std": float(initial["model.layers.0.mlp.0.weight"].std()),
        "layer_norm": [float(initial["model.layers.1.ln_1.weight"].min()), float(initial["model.layers.1.ln_1.bias"].abs().max())],
        "tied": bool(torch.equal(initial["model.lm_head.weight"], initial["model.embed_tokens.weight"])),
        "checksum": float(sum(t.double().sum() for t in initial.values())),
        "linear": torch.nn.functional.linear.__name__,
    }
    Path(out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main(*sys.argv[1:])
