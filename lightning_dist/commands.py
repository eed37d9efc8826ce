"""`lightning-dist`: the package's commands for the steps before and after training, under one name, as `git` or
`huggingface-cli` has them. Training itself is `lightning-dist-train [overrides]` (`python train.py` from any
directory): Lightning starts a run's other ranks by running its command line again, which must be the training one.

    lightning-dist consolidate CHECKPOINT OUT.ckpt   # any strategy's checkpoint as one plain file
    lightning-dist export [CHECKPOINT] OUT_DIR       # a Hugging Face model's as a save_pretrained folder
    lightning-dist generate CHECKPOINT --prompt "The "   # or a save_pretrained folder
    lightning-dist prepare [OP or PRESET ...]        # DeepSpeed's native ops, built ahead of the first run
    lightning-dist sweep-report MULTIRUN_DIR

Each subcommand is its module's own command line (`lightning-dist generate --help`); each module is imported only
when its command runs, so `lightning-dist --help` answers at once.
"""

from __future__ import annotations

import sys
from importlib import import_module

# name: (the module whose `main` runs it, what it does)
COMMANDS = {
    "consolidate": ("lightning_dist.checkpoints.consolidate", "write any strategy's checkpoint as one plain file"),
    "export": ("lightning_dist.models.export", "a Hugging Face model's checkpoint as a save_pretrained folder"),
    "generate": ("lightning_dist.models.generate", "text from a checkpoint or a save_pretrained folder"),
    "prepare": ("lightning_dist.prepare", "build DeepSpeed's native ops ahead of the first run that needs them"),
    "sweep-report": ("lightning_dist.reports.sweep_report", "a multirun's table and curves"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return ("usage: lightning-dist COMMAND [arguments]\n\n" + "\n".join(lines)
            + "\n\nlightning-dist COMMAND --help: its own. Training: lightning-dist-train [overrides]")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: lightning-dist {name}: no such command; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    sys.argv[0] = f"lightning-dist {name}"  # argparse names the command in its usage and errors so
    return import_module(COMMANDS[name][0]).main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
