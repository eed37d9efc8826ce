"""Attention written three ways, as models in the wild write it: `F.scaled_dot_product_attention` by that name,
the same function imported under another name at this module's top, and the softmax of q k^T written out."""

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.functional import scaled_dot_product_attention as sdpa


class Attention(nn.Module):
    def __init__(self, how: str, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.how, self.heads = how, heads
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (t.reshape(batch, length, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        if self.how == "by name":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.how == "aliased":
            out = sdpa(q, k, v, is_causal=True)
        else:  # written out
            scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
            causal = torch.ones(length, length, dtype=torch.bool).triu(1)
            out = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        return x + out.transpose(1, 2).reshape(batch, length, width)


class Stack(nn.Module):
    def __init__(self, how: str, blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Attention(how) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x
