"""A small GPT-style byte-level language model: the package's embedded default.

`TransformerBlock` is the unit that FSDP shards and activation checkpointing wraps; the model config names it
(`model.block_class`) so strategies never have to guess.
"""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.text import Perplexity

from lightning_dist.optim import ConfiguredOptimizers
from lightning_dist.optim.configured import OptimizerFactory, SchedulerFactory
from lightning_dist.parallel.logged_means import mean_when_logged
from lightning_dist.parallel.sharded_init import draw_init_seed, initialize_parameters


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"model.d_model={d_model} must be divisible by model.n_head={n_head}")
        self.head_dim = d_model // n_head
        # Separate projections, so that a tensor-parallel split of each gives every rank whole heads of q, k and v.
        self.q, self.k, self.v = (nn.Linear(d_model, d_model) for _ in range(3))
        self.proj = nn.Linear(d_model, d_model)
        self.proj.residual_projection = True  # type: ignore[assignment]  # a flag for _init_weights
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        # The heads this rank holds: all of them, or its share under tensor parallelism (`GPT.tp_plan`).
        q, k, v = (m(x).view(batch, time, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        return self.proj(y.transpose(1, 2).reshape(batch, time, -1))


class TransformerBlock(nn.Module):
    """Pre-norm attention + MLP block."""

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.mlp[2].residual_projection = True  # type: ignore[assignment]  # a flag for _init_weights
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_attn(x)))
        return x + self.drop(self.mlp(self.ln_mlp(x)))


class GPT(nn.Module):
    """Token + position embeddings, a stack of blocks, and an output head tied to the token embedding."""

    # How tensor parallelism splits each block (lightning_dist/parallel/tensor_parallel.py): attention heads and the
    # MLP's hidden features across the ranks of a tensor-parallel group, Megatron-LM's split.
    tp_plan = {
        "blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
        "blocks.*.attn.proj": "rowwise", "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise",
    }

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, d_model: int, dropout: float):
        super().__init__()
        self.init_seed = draw_init_seed()  # before any layer: layers built on the meta device draw nothing
        self.n_layer = n_layer
        self.block_size = block_size
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList(self.make_block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_out = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.token_embedding.weight  # weight tying, as in GPT-2
        # Module by module, seeded by name: a sharding strategy that built this on the meta device initialises
        # its shards with the same function later, and gets the same weights (lightning_dist/parallel/sharded_init.py).
        initialize_parameters(self)

    def make_block(self, d_model: int, n_head: int, dropout: float) -> nn.Module:
        return TransformerBlock(d_model, n_head, dropout)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            # GPT-2's scaled init of residual projections keeps the residual stream's variance flat with depth.
            scale = math.sqrt(2 * self.n_layer) if getattr(module, "residual_projection", False) else 1.0
            nn.init.normal_(module.weight, std=0.02 / scale)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    # The way into the blocks and out of them: pipeline parallelism runs `embed` on its first stage and `head` on its
    # last (lightning_dist/parallel/pipeline_split.py).
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.token_embedding(tokens) + self.position_embedding(positions)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_out(x))


class GPTLanguageModel(ConfiguredOptimizers, L.LightningModule):
    """Next-byte prediction; logs loss and perplexity (synced across ranks by torchmetrics).

    `optimizer` and `scheduler` are what the `optimizer/` and `scheduler/` config groups give (partials called with
    the parameter groups and the optimizer); without them, AdamW at a constant rate (`DEFAULT_OPTIMIZER`).
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        d_model: int = 128,
        dropout: float = 0.0,
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
    ) -> None:
        super().__init__()
        # The factories are code, not data: kept out of the checkpoint's hyper-parameters, which load as data only.
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.model = self.build_model(vocab_size, block_size, n_layer, n_head, d_model, dropout)
        self.val_loss = MeanMetric()
        self.val_perplexity = Perplexity()
        self.test_loss = MeanMetric()
        self.test_perplexity = Perplexity()

    def build_model(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, d_model: int,
                    dropout: float) -> GPT:
        return GPT(vocab_size, block_size, n_layer, n_head, d_model, dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def _logits_and_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = batch
        logits = self(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        _, loss = self._logits_and_loss(batch)
        # The mean over the data-parallel ranks where the loggers write it: a curve that means the same at any
        # number of ranks (Lightning's own logs rank 0's batch alone).
        self.log("train_loss", mean_when_logged(self, loss), prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, self.val_loss, self.val_perplexity, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, self.test_loss, self.test_perplexity, "test")

    def _evaluate(self, batch, loss_metric: MeanMetric, perplexity: Perplexity, stage: str) -> None:
        logits, loss = self._logits_and_loss(batch)
        loss_metric.update(loss, weight=batch[1].numel())
        perplexity.update(logits.float(), batch[1])
        self.log(f"{stage}_loss", loss_metric, prog_bar=True)
        self.log(f"{stage}_ppl", perplexity)

    def on_validation_epoch_end(self) -> None:
        # Lightning drops what is logged during the sanity check; we keep it as the curve's step-0 point so a
        # run shows its validation loss before training and after.
        if self.trainer.sanity_checking and self.loggers:
            initial = {"val_loss": self.val_loss.compute().item(), "val_ppl": self.val_perplexity.compute().item()}
            if self.trainer.is_global_zero:
                for logger in self.loggers:
                    logger.log_metrics(initial, step=0)
