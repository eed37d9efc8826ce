"""The default model with one device bug at a time, for the CUDA dry run to find (tests/test_dry_run_on_cuda.py).
Each passes every CPU test: on the host, every tensor is on the one device there is."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_dist.models.gpt import GPT, GPTLanguageModel


class _PositionsOnTheHost(GPT):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1])  # the bug: no device, so made on the host
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_out(x))


class _PositionsOnTheFirstDevice(GPT):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device="cuda:0")  # the bug: every rank's on device 0
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_out(x))


class BuggyGPT(GPTLanguageModel):
    """GPTLanguageModel with `bug`: "host_positions", "device_0_positions", "host_count_gathered" or None."""

    def __init__(self, bug: str | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.bug = bug
        forwards = {"host_positions": _PositionsOnTheHost, "device_0_positions": _PositionsOnTheFirstDevice}
        if bug in forwards:
            self.model.__class__ = forwards[bug]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.bug == "host_count_gathered":
            count = torch.tensor(batch[0].numel())  # the bug: a host tensor, which nccl cannot send
            counts = [torch.zeros_like(count) for _ in range(dist.get_world_size())]
            dist.all_gather(counts, count)
        return loss


def dry_run_each(runs: dict[str, tuple]) -> dict[str, list]:
    """Each named dry run (`dry_run_configured`'s arguments) in this one process: for the process with CUDA faked,
    started once for every preset."""
    from lightning_dist.dry_run import dry_run_configured

    return {name: dry_run_configured(*arguments) for name, arguments in runs.items()}
