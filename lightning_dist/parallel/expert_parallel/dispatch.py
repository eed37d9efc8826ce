"""Tokens to the ranks that hold their experts and the experts' outputs back: two all-to-alls around each rank's
experts, as torchtitan's and Megatron's token dispatchers do.

Each rank of an expert-parallel group of `ranks` holds `local` consecutive experts (rank r: experts r*local to
(r+1)*local - 1). A rank sorts its (token, chosen expert) pairs by expert, so that the pairs for each rank are one
run; tells each rank how many it sends to each of that rank's experts (an all-to-all of counts, and one host read:
the collectives' split sizes are host integers); sends the tokens' hidden states; each rank runs what arrived
through its experts, grouped by expert; the outputs go back the same way, and each rank weighs them by its routing
weights and adds them up per token. Both all-to-alls are differentiable (backward sends the gradients back the
reverse way), so an expert's gradient has every token that chose it on any rank of the group; the routing weights'
gradients stay with the rank that routed.

FSDP then averages each expert's gradient over the ranks left to it, data-parallel ranks / `ranks` of them, where
the other weights' are averaged over all data-parallel ranks: the experts' are scaled by 1 / `ranks` on the way in
(and what flows back to the tokens by `ranks` again), so that both are the mean over every rank's tokens. (FSDP2's
own divide factor would do it, but its reduce op with a factor is NCCL's PREMUL_SUM, which gloo lacks, and torch
2.13 divides twice over a mesh of one rank.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_dist._compat.fake_tensors import is_fake
from lightning_dist._compat.torch import all_to_all_with_gradients

# Runs the tokens that arrived through this rank's experts: (hidden states, each row's expert of this rank's, the
# rows for each of them) -> outputs.
RunLocal = Callable[[torch.Tensor, torch.Tensor, list[int]], torch.Tensor]


class ScaleGradient(torch.autograd.Function):
    """`tensor` unchanged; its gradient times `scale`."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _even_split(pairs: int, ranks: int, local: int, rank: int) -> tuple[list[int], list[int]]:
    """(pairs this rank sends each expert, pairs it receives for each of its experts from each rank) when every
    rank's `pairs` (token, expert) pairs spread evenly over the `ranks x local` experts."""
    experts = ranks * local
    even = [pairs // experts + (1 if expert < pairs % experts else 0) for expert in range(experts)]
    return even, [even[rank * local + expert] for _ in range(ranks) for expert in range(local)]


def dispatch_and_combine(hidden: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, *, group: Any,
                         ranks: int, local: int, run_local: RunLocal) -> torch.Tensor:
    """The weighted sum, per token of `hidden` (tokens x features), of the outputs of the experts `chosen` for it
    (tokens x k, global expert indices) weighed by `weights` (tokens x k), its experts run on the `ranks` ranks of
    `group` that hold them, `local` a rank."""
    flat = chosen.reshape(-1)
    order = flat.argsort(stable=True)  # the (token, expert) pairs by expert: each destination's pairs in one run
    token = order // chosen.shape[-1]
    # How many pairs for each expert (bincount's shape depends on the values: a fake tensor has none)
    counts = flat.new_zeros(ranks * local).scatter_add_(0, flat, torch.ones_like(flat))
    arriving = all_to_all_with_gradients(counts, group)  # from each rank, how many for each of my experts
    if is_fake(counts):  # a dry run's: no counts to read; its tokens spread evenly over the experts, on every rank
        sent_per_expert, arrived_per_expert = _even_split(flat.numel(), ranks, local, dist.get_rank(group))
    else:
        sent_per_expert, arrived_per_expert = torch.stack([counts, arriving]).tolist()  # the one host read
    sent = [sum(sent_per_expert[r * local:(r + 1) * local]) for r in range(ranks)]
    arrived = [sum(arrived_per_expert[r * local:(r + 1) * local]) for r in range(ranks)]
    received = all_to_all_with_gradients(hidden[token], group, arrived, sent)
    # What arrived is ordered by source rank, then by expert: each row's expert (of this rank's, from 0).
    # The counts made on the host, then copied: a dry run's fake devices make no tensor from data on a device.
    expert_of_row = torch.repeat_interleave(torch.arange(local, device=hidden.device).repeat(ranks),
                                            torch.tensor(arrived_per_expert).to(hidden.device),
                                            output_size=sum(arrived))
    rows_per_expert = [sum(arrived_per_expert[r * local + e] for r in range(ranks)) for e in range(local)]
    outputs = run_local(ScaleGradient.apply(received, float(ranks)), expert_of_row, rows_per_expert)
    outputs = ScaleGradient.apply(outputs, 1.0 / ranks)
    returned = all_to_all_with_gradients(outputs, group, sent, arrived)
    weighed = returned * weights.reshape(-1)[order, None].to(returned.dtype)
    return torch.zeros_like(hidden).index_add_(0, token, weighed.to(hidden.dtype))
