"""Compile DeepSpeed's native ops ahead of time, so that no run waits minutes on its first use: in a Docker layer, a
SLURM prolog, or once on a new machine.

    lightning-dist prepare                               # cpu_adam; async_io too where libaio's headers are installed
    lightning-dist prepare deepspeed_stage_3_offload     # what a preset needs (here cpu_adam), nothing more
    lightning-dist prepare cpu_adam async_io             # these ops; exit 1 if one cannot be built

Each op is compiled into this environment's own cache (`<venv>/torch_extensions`, or TORCH_EXTENSIONS_DIR where
set: lightning_dist/lifecycle/op_builds.py), with a line before each build and one every minute while it runs.
Exit 1 only for an op that was asked for (by name, or by a preset that needs it) and cannot be built; it says what
to install. The shared-memory comm op is never needed: our strategies start DeepSpeed without it.
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

    builder = get_accelerator().create_op_builder(BUILDERS[name])
    if builder is None:
        return f"DeepSpeed has no {name} op for the {get_accelerator().device_name()} accelerator"
    if problem := _cannot_build(name):
        return problem
    builder.load(verbose=False)
    return None


def _cannot_build(name: str) -> str | None:
    from deepspeed.accelerator import get_accelerator

    from lightning_dist.strategies.deepspeed.config.preflight import INSTALL_HINTS

    builder = get_accelerator().create_op_builder(BUILDERS[name])
    return None if builder is not None and builder.is_compatible(verbose=False) else INSTALL_HINTS[BUILDERS[name]]


def ops_of_preset(name: str) -> list[str]:
    """The native ops a preset's runs load: CPU Adam for an offloaded optimizer, async_io for anything on NVMe."""
    from lightning_dist.strategies.presets import PRESETS

    options = PRESETS[name].kwargs
    places = {options.get("offload_optimizer"), options.get("offload_parameters")}
    return [op for op, needed in (("cpu_adam", options.get("offload_optimizer") in ("cpu", "nvme")),
                                  ("async_io", "nvme" in places)) if needed]


def main(argv: list[str] | None = None) -> int:
    from lightning_dist.strategies.presets import PRESETS

    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("names", nargs="*", metavar="op_or_preset",
                        help=f"{', '.join(BUILDERS)}, or a preset (strategy=NAME or NAME); none: cpu_adam, and"
                             " async_io where it can be built")
    args = parser.parse_args(argv)
    asked: list[str] = []
    for given in args.names:
        name = given.removeprefix("strategy=")
        if name in BUILDERS:
            asked.append(name)
        elif name in PRESETS:
            needed = ops_of_preset(name)
            print(f"{name}: {', '.join(needed) if needed else 'no native op (nothing to build)'}")
            asked += needed
        else:
            parser.error(f"{given}: no such op or preset; choose an op ({', '.join(BUILDERS)}) or a preset"
                         f" ({', '.join(PRESETS)})")
    import torch

    if not torch.cuda.is_available():  # said, so DeepSpeed need not detect it: its warning that it fell back to the
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # CPU was the first line a machine without a GPU printed
    from lightning_dist._compat.deepspeed import op_build_directory, remember_cpu_info
    from lightning_dist.lifecycle.op_builds import announce_op_builds

    remember_cpu_info()
    announce_op_builds(lambda line: print(line, flush=True))
    wanted = list(dict.fromkeys(asked)) if args.names else list(BUILDERS)
    failed = 0
    for name in wanted:
        if not args.names and (problem := _cannot_build(name)):  # not asked for by name: said, not a failure
            print(f"{name}: skipped, it cannot be built here: {problem}")
            continue
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
