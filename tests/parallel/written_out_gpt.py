"""The bundled GPT with its attention written out (the softmax of q k^T), as a user's model may write it: context
parallelism cannot exchange such attention, and must say so, in a run and in a dry run."""

from __future__ import annotations

import math

import torch

from lightning_dist.models.gpt import GPT, CausalSelfAttention, GPTLanguageModel, TransformerBlock


class WrittenOutAttention(CausalSelfAttention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        q, k, v = (m(x).view(batch, time, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        causal = torch.ones(time, time, dtype=torch.bool, device=x.device).triu(1)
        y = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(batch, time, -1))


class WrittenOutBlock(TransformerBlock):
    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__(d_model, n_head, dropout)
        self.attn = WrittenOutAttention(d_model, n_head, dropout)


class WrittenOutGPT(GPT):
    def make_block(self, d_model: int, n_head: int, dropout: float) -> WrittenOutBlock:
        return WrittenOutBlock(d_model, n_head, dropout)


class WrittenOutGPTLanguageModel(GPTLanguageModel):
    def build_model(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, d_model: int,
                    dropout: float) -> GPT:
        return WrittenOutGPT(vocab_size, block_size, n_layer, n_head, d_model, dropout)
