"""Launching runs under Hydra: each sweep job in a process of its own (Hydra-side; the strategies know nothing of
Hydra)."""

from lightning_dist.launch.isolated_job import JobFailed, needs_isolation, run_isolated

__all__ = ["JobFailed", "needs_isolation", "run_isolated"]
