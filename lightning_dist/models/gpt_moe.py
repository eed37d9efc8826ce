"""A mixture-of-experts variant of the bundled GPT (`model=gpt_moe`): each block's MLP becomes a routed layer of
experts, as Mixtral, Qwen2-MoE and DeepSeek build theirs.

- A linear router scores the experts for each token; the top k are chosen and their softmax probabilities,
  renormalised over the k, weigh their outputs (Mixtral's routing).
- The experts are one module each (an `nn.ModuleList` of MLPs, the layout of most MoE code written before fused
  expert kernels, called as transformers calls its fused experts), and an expert no token chose is not called. That
  is the layout that hangs ZeRO-3 (DeepSpeed #4808: a rank that skips an expert never gathers its parameters, which
  the ranks that call it wait for) and that DDP refuses (a parameter without a gradient); the strategies handle it,
  not the model (lightning_dist/parallel/experts.py).
- An optional shared expert, which every token goes through besides its routed ones (Qwen2-MoE, DeepSeek).
- A load-balancing loss (Switch Transformer's: experts x the sum over experts of the share of tokens routed to each
  times its mean router probability; 1.0 when the load is even) whose gradient enters backward where it is computed
  (`AuxiliaryLoss`, DeepSeek's way): it needs no path through the model's output, so it is the same under
  activation checkpointing and in every pipeline stage. The logged `train_loss` is the language model's alone.
- Each layer keeps its last forward's tokens per expert (`tokens_per_expert`), which the training monitor logs as
  the load's max / mean (`monitor/expert_load/LAYER`), and its balance loss (`balance_loss`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_dist.models.gpt import GPT, CausalSelfAttention, GPTLanguageModel
from lightning_dist.optim.configured import OptimizerFactory, SchedulerFactory


class AuxiliaryLoss(torch.autograd.Function):
    """Returns `output` unchanged; in backward, `loss` also gets a gradient of 1, so that `loss` is minimised with
    the model's loss without being added to it (DeepSeek-V2's `AddAuxiliaryLoss`)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_dtype, ctx.loss_device = loss.dtype, loss.device
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad_output, torch.ones((), dtype=ctx.loss_dtype, device=ctx.loss_device)


def expert_mlp(d_model: int) -> nn.Sequential:
    mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
    mlp[2].residual_projection = True  # type: ignore[assignment]  # a flag for GPT._init_weights
    return mlp


class RoutedExperts(nn.ModuleList):
    """The experts of one layer, one module each, called as transformers calls its fused experts modules
    (`MixtralExperts`): each token's hidden state, the experts it chose and their weights in, the weighted sum of
    their outputs out. An expert no token chose is not called. Expert parallelism
    (lightning_dist/parallel/expert_parallel) splits a layer's experts over ranks at this call."""

    def forward(self, hidden: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        routed = torch.zeros_like(hidden)
        for index, expert in enumerate(self):
            token, slot = torch.where(chosen == index)
            if token.numel() == 0:  # not called: the layout that hangs ZeRO-3 unless its MoE layers are leaves
                continue
            routed.index_add_(0, token, expert(hidden[token]) * weights[token, slot, None])
        return routed


class MixtureOfExperts(nn.Module):
    """Top-k routing over `n_experts` MLPs, an optional shared expert, and the load-balancing loss (its coefficient
    `balance`) whose gradient enters backward here."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, shared_expert: bool, balance: float) -> None:
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"model.top_k={top_k}: choose from 1 to model.n_experts={n_experts}")
        self.top_k, self.balance = top_k, balance
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = RoutedExperts(expert_mlp(d_model) for _ in range(n_experts))
        self.shared_expert = expert_mlp(d_model) if shared_expert else None
        self.tokens_per_expert: torch.Tensor | None = None
        self.balance_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probabilities = self.router(flat).float().softmax(dim=-1)
        weights, chosen = probabilities.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(flat.dtype)
        routed = self.experts(flat, chosen, weights)
        if self.shared_expert is not None:
            routed = routed + self.shared_expert(flat)
        counts = F.one_hot(chosen, len(self.experts)).sum(dim=(0, 1))
        self.tokens_per_expert = counts.detach()
        share = counts.float() / chosen.numel()  # of the token-to-expert assignments, no gradient
        self.balance_loss = len(self.experts) * (share * probabilities.mean(dim=0)).sum()
        if self.training and self.balance > 0 and torch.is_grad_enabled():
            routed = AuxiliaryLoss.apply(routed, self.balance * self.balance_loss)
        return routed.view_as(x)


class MoEBlock(nn.Module):
    """Pre-norm attention + mixture-of-experts block."""

    def __init__(self, d_model: int, n_head: int, dropout: float, n_experts: int, top_k: int, shared_expert: bool,
                 balance: float) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.moe = MixtureOfExperts(d_model, n_experts, top_k, shared_expert, balance)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_attn(x)))
        return x + self.drop(self.moe(self.ln_mlp(x)))


class GPTMoE(GPT):
    """The bundled GPT with `MoEBlock`s. Tensor parallelism splits attention as GPT's plan does and each expert's
    MLP as GPT's MLP (the router and the routing stay whole on each rank)."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, d_model: int, dropout: float,
                 n_experts: int, top_k: int, shared_expert: bool, balance: float) -> None:
        self._moe = (n_experts, top_k, shared_expert, balance)
        super().__init__(vocab_size, block_size, n_layer, n_head, d_model, dropout)
        experts = ["blocks.*.moe.experts.*"] + ["blocks.*.moe.shared_expert"] * shared_expert
        self.tp_plan = {name: style for name, style in GPT.tp_plan.items() if ".mlp." not in name} | {
            f"{mlp}.{index}": style for mlp in experts for index, style in (("0", "colwise"), ("2", "rowwise"))}

    def make_block(self, d_model: int, n_head: int, dropout: float) -> nn.Module:
        return MoEBlock(d_model, n_head, dropout, *self._moe)


class GPTMoELanguageModel(GPTLanguageModel):
    """`GPTLanguageModel` on `GPTMoE`: `n_experts` experts a block, `top_k` of them a token, an optional shared
    expert, and the load-balancing loss weighed by `balance`."""

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        d_model: int = 128,
        dropout: float = 0.0,
        n_experts: int = 8,
        top_k: int = 2,
        shared_expert: bool = False,
        balance: float = 0.01,
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
    ) -> None:
        self._moe = (n_experts, top_k, shared_expert, balance)
        super().__init__(vocab_size, block_size, n_layer, n_head, d_model, dropout, optimizer, scheduler)

    def build_model(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, d_model: int,
                    dropout: float) -> GPT:
        return GPTMoE(vocab_size, block_size, n_layer, n_head, d_model, dropout, *self._moe)
