"""Where each process of a run that a cluster's launcher started (torchrun, srun) writes its Hydra log and config.

Every such process runs Hydra itself, in the one run directory the nodes share: the ranks of a SLURM job appended
to one `train.log`, and each node wrote `.hydra/` over the others' (the last writer won). Now global rank 0 keeps
`train.log` and `.hydra/`; rank R logs to `train.rank<R>.log`; the first rank of node N keeps that node's config
as `.hydra.node<N>/` (the node's other ranks have the same). Ranks that Lightning starts name their own logs
(`train_ddp_process_<N>.log`) and keep no config; a process no launcher started is rank 0.
"""

from __future__ import annotations

import os

from omegaconf import OmegaConf

# Each launcher's variables for the process's global rank, its rank on its node, and its node.
_LAUNCHER_VARIABLES = (("RANK", "LOCAL_RANK", "GROUP_RANK"), ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID"))


def launcher_ranks() -> tuple[int, int, int]:
    """(global rank, local rank, node rank) as this process's launcher gave them; (0, 0, 0) where none did."""
    for names in _LAUNCHER_VARIABLES:
        values = [os.environ.get(name, "") for name in names]
        if all(value.isdigit() for value in values):
            return int(values[0]), int(values[1]), int(values[2])
    return 0, 0, 0


def log_suffix() -> str:
    rank, _, _ = launcher_ranks()
    return f".rank{rank}" if rank else ""


def config_subdir() -> str | None:
    rank, local_rank, node = launcher_ranks()
    if rank == 0:
        return ".hydra"
    return f".hydra.node{node}" if local_rank == 0 and node > 0 else None


OmegaConf.register_new_resolver("ld.log_suffix", log_suffix, replace=True)
OmegaConf.register_new_resolver("ld.config_subdir", config_subdir, replace=True)
