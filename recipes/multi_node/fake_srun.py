"""A stand-in for `srun` on a machine without SLURM: starts SLURM_NTASKS copies of the command, each with the
variables srun gives its task (SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID), and exits with the first non-zero
code. `sbatch`'s own variables must already be set. For the recipe's smoke test; never needed on a cluster.

    PATH=recipes/multi_node/bin:$PATH SLURM_NTASKS=2 ... bash recipes/multi_node/train.sbatch
"""

from __future__ import annotations

import os
import subprocess
import sys


def main(argv: list[str]) -> int:
    command = [arg for arg in argv if not arg.startswith("--")]  # srun's own options (--kill-on-bad-exit=1)
    tasks, per_node = int(os.environ["SLURM_NTASKS"]), int(os.environ["SLURM_NTASKS_PER_NODE"])
    processes = [
        subprocess.Popen(command, env={
            **os.environ, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % per_node), "SLURM_NODEID": str(rank // per_node),
        })
        for rank in range(tasks)
    ]
    codes = [process.wait() for process in processes]
    return next((code for code in codes if code), 0)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
