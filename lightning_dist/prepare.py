"""Compile DeepSpeed's native ops ahead of time, so that no run waits minutes in silence on its first use: in a
Docker layer, a SLURM prolog, or once on a new machine.

    python -m lightning_dist.prepare              # cpu_adam (optimizer offload) and async_io (NVMe offload)
    python -m lightning_dist.prepare cpu_adam     # only what your runs need

Each op is built into torch's extension cache (TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions), which every
process on the machine reuses. The shared-memory comm op is never needed: our strategies start DeepSpeed without it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

BUILDERS = {"cpu_adam": "CPUAdamBuilder", "async_io": "AsyncIOBuilder"}


def prepare(name: str) -> str | None:
    """Build (or find built) op `name`; None when it is ready, else what to install."""
    from deepspeed.accelerator import get_accelerator

    from lightning_dist.strategies.deepspeed.config.preflight import INSTALL_HINTS

    builder = get_accelerator().create_op_builder(BUILDERS[name])
    if builder is None:
        return f"DeepSpeed has no {name} op for the {get_accelerator().device_name()} accelerator"
    if not builder.is_compatible(verbose=False):
        return INSTALL_HINTS[BUILDERS[name]]
    builder.load(verbose=False)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("ops", nargs="*", metavar="op", help=f"{' or '.join(BUILDERS)} (default: both)")
    args = parser.parse_args(argv)
    if unknown := [name for name in args.ops if name not in BUILDERS]:
        parser.error(f"{unknown[0]}: no such op; choose from {', '.join(BUILDERS)}")
    import torch

    if not torch.cuda.is_available():  # said, so DeepSpeed need not detect it: its warning that it fell back to the
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # CPU was the first line a machine without a GPU printed
    from lightning_dist._compat.deepspeed import op_build_directory, remember_cpu_info
    from lightning_dist.lifecycle.op_build_lock import announce_op_builds

    remember_cpu_info()
    announce_op_builds(lambda line: print(line, flush=True))
    failed = 0
    for name in args.ops or list(BUILDERS):
        started = time.monotonic()
        problem = prepare(name)
        if problem:
            failed += 1
            print(f"{name}: cannot be built here: {problem}", file=sys.stderr)
        else:
            print(f"{name}: ready in {time.monotonic() - started:.1f} s ({op_build_directory(name)})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
