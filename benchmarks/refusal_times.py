"""How long each refusal of tests/test_config_errors.py takes to decide, all of them in one process (the imports
paid once, as a warm interpreter pays them): the command line's checks, then, where they pass, the build of the run
(model on the meta device, strategy, callbacks, trainer) that refuses the rest before any rank starts.

    python -m benchmarks.refusal_times            # a table, slowest first; exit 1 if any takes 2 s or more

The command line itself (a fresh interpreter, Hydra's imports) is benchmarks/cli_startup.py's.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from lightning_dist.lifecycle.writable import unwritable_because
from lightning_dist.reports.console import quiet_console
from lightning_dist.run.compose import build
from lightning_dist.run.compose import compose as compose_run
from lightning_dist.run.config_check import ConfigError, check_launcher, check_overrides
from lightning_dist.run.config_values import check_values
from lightning_dist.run.simulate import refuse_what_a_dry_run_cannot_follow
from lightning_dist.strategies.launcher import PreflightError, preflight
from tests.conftest import CONF_DIR
from tests.test_config_errors import REFUSED, write_inputs

TARGET_S = 2.0


def refusal(arguments: list[str]) -> str | None:
    """The one line the run's checks refuse `arguments` with, or None: what train.py checks before any rank starts
(lightning_dist/run/cli.py, then run/train.py up to its preflight)."""
    sweep = "-m" in arguments
    overrides = [a for a in arguments if a != "-m"]
    if config_dir := next((a.partition("=")[2] for a in overrides if a.startswith("--config-dir=")), None):
        overrides = [*(a for a in overrides if not a.startswith("--config-dir=")), f"hydra.searchpath=[file://{config_dir}]"]
    try:
        cfg = check_overrides(overrides, config_name="train")
        if cfg is not None:
            check_values(cfg)
        if sweep:
            check_launcher(overrides, config_name="train")
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("train", overrides=[o for o in overrides if not _swept(o)], return_hydra_config=True)
        directory = cfg.hydra.sweep.dir if sweep else cfg.hydra.run.dir
        if why := unwritable_because(directory):
            return f"hydra.{'sweep' if sweep else 'run'}.dir: cannot write {directory} ({why})"
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = tempfile.mkdtemp()  # what Hydra sets when it runs the job
        HydraConfig.instance().set_config(cfg)
        if cfg.get("dry_run") is True:  # train.py's dry run checks what it can follow, then steps on fake tensors
            refuse_what_a_dry_run_cannot_follow(compose_run(cfg, choose=False))
            return None
        parts = build(cfg)
        preflight(parts["trainer"], model=parts["model"], datamodule=parts["datamodule"])  # as train.py, before launch
    except ConfigError as error:
        return str(error)
    except PreflightError as error:
        return " ".join(str(error).split())
    return None


def _swept(override: str) -> bool:
    """Whether `override` gives a sweep's values (`strategy=ddp,fsdp`), not one value with commas (a dict, a list)."""
    value = override.partition("=")[2]
    return "," in value and not value.startswith(("{", "["))


def main() -> int:
    quiet_console()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        inputs = Path(work) / "inputs"
        write_inputs(inputs)
        refusal(["trainer.max_steps=1"])  # the imports and first build, paid once as a warm process pays them
        for arguments, expected in REFUSED:
            typed = [a.replace("{inputs}", str(inputs)) for a in arguments]
            started = time.perf_counter()
            said = refusal(typed)
            rows.append((time.perf_counter() - started, " ".join(arguments), said))
    print("| refusal | seconds | / target |")
    print("|---|---:|---:|")
    for seconds, typed, said in sorted(rows, reverse=True):
        mark = "" if said else " (not refused in one process)"
        print(f"| `{typed}`{mark} | {seconds:.3f} | {seconds / TARGET_S:.2f} |")
    slowest = max(seconds for seconds, _, _ in rows)
    print(f"\n{len(rows)} refusals; slowest {slowest:.2f} s; target: under {TARGET_S:.0f} s each")
    return 0 if slowest < TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
