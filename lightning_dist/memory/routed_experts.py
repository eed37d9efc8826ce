"""Mixture-of-experts layers in the memory plan's trace on the meta device.

A layer's experts each run on the tokens its router chose for them, found by value (`torch.where`, `nonzero`), which
meta tensors do not have. But what the experts save for backward does not depend on which tokens went where: every
(token, chosen expert) pair is one row through one expert, so a step saves `tokens x top_k` rows of each expert's
activations, however the router spread them. So the trace runs each experts module (called as
`experts(hidden_states, top_k_index, top_k_weights)`, parallel/expert_parallel/layers.py) on the same number of rows
without looking at the routing's values:
- transformers' fused experts through its own grouped implementation (the pairs sorted by expert, one product per
  expert over its rows), which runs on meta tensors with the per-expert loop it falls back to
  (`_compat/transformers.py`);
- a list of one module per expert (`model=gpt_moe`) on the pairs in equal shares, each expert (of those the rank
  holds, under expert parallelism) its share.

Each experts module is counted as it is called, so the plan can say how many parameters a token uses (`top_k` of
each layer's experts, and everything else) beside how many the model holds; a module the traced step did not reach
this way stops the plan in one line rather than leave its activations out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_dist._compat.transformers import grouped_experts_on_meta
from lightning_dist.parallel.expert_parallel.layers import CALL, experts_count, experts_modules


@dataclass
class RoutedExperts:
    """The experts modules of a model and, once traced, each one's top-k (how many experts a token uses there)."""

    modules: list[tuple[str, nn.Module]]
    top_k: dict[str, int] = field(default_factory=dict)

    def inactive_parameters(self) -> int:
        """Trainable elements of the experts a token does not use: (experts - top_k) / experts of each layer's."""
        unused = 0
        for name, module in self.modules:
            count = experts_count(module)
            trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
            unused += trained * (count - self.top_k[name]) // count
        return unused


def _in_equal_shares(experts: nn.ModuleList) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """A forward for a list of experts that gives each expert an equal share of the (token, expert) pairs."""

    def forward(hidden: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # The experts this rank holds: under expert parallelism the others' places hold no parameters, and what
        # arrives here is for its own (parallel/expert_parallel/layers.py).
        held = [expert for expert in experts if next(expert.parameters(), None) is not None]
        order = chosen.reshape(-1).argsort(stable=True)
        token = order // chosen.shape[-1]
        rows = order.numel()
        share = -(-rows // len(held))
        picked = hidden[token]
        outputs = torch.cat([expert(picked[e * share:(e + 1) * share]) for e, expert in enumerate(held)])
        weighed = outputs[:rows] * weights.reshape(-1)[order, None].to(outputs.dtype)
        return torch.zeros_like(hidden).index_add(0, token, weighed.to(hidden.dtype))

    return forward


@contextmanager
def experts_traced_on_meta(model: nn.Module) -> Iterator[RoutedExperts]:
    """Within: `model`'s experts modules run on meta (or fake) tensors as the module docstring says, each call's top-k
    recorded (the plan's trace, and the dry run's steps).
    After: ValueError in one line naming an experts module the step did not call that way."""
    routed = RoutedExperts(experts_modules(model))
    with ExitStack() as stack:
        for name, module in routed.modules:
            def record(module: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
                routing = [*args, *kwargs.values()]  # (hidden states, top-k indices, top-k weights), by name or not
                routed.top_k[name] = routing[1].shape[-1] if len(routing) > 1 else 0

            stack.callback(module.register_forward_pre_hook(record, with_kwargs=True).remove)
            if isinstance(module, nn.ModuleList):
                module.forward = _in_equal_shares(module)
                stack.callback(module.__dict__.pop, "forward")
            elif hasattr(module, "config"):  # transformers': another library's fused experts trace as they are
                stack.enter_context(grouped_experts_on_meta(module))
        yield routed
    missed = [name for name, _ in routed.modules if not routed.top_k.get(name)]
    if missed:
        raise ValueError(f"{type(model).__name__}'s traced step did not call {missed[0]} as {CALL}, so the memory"
                         " plan cannot count what its experts save; call the experts module that way")
