"""The command line: `python train.py [overrides]` and `lightning-dist-train [overrides]`.

    python train.py                                   # the embedded default: tiny GPT on pydoc text, DDP, 2 CPU ranks
    python train.py strategy=deepspeed_stage_3_offload
    python train.py -m strategy=ddp,fsdp               # a sweep: logs/train/multiruns/<date>/<job>

Only Hydra is imported here: `--help`, `--cfg job` and a refused override answer without loading torch, Lightning
or DeepSpeed (several seconds); the job itself (`lightning_dist/run/job.py`) imports them when it runs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from lightning_dist.lifecycle.error_line import say_error
from lightning_dist.lifecycle.exits import exit_with
from lightning_dist.run.config_check import CONF_DIR, ConfigError, check_launcher, check_overrides
from lightning_dist.run.config_values import check_values


@hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")
def _hydra_entry(cfg: DictConfig) -> Any:
    from lightning_dist.lifecycle.stop_signals import leaving_as_the_stop

    with leaving_as_the_stop():  # before Hydra prints the traceback of a job that failed
        from lightning_dist.run.job import run_job

        return run_job(cfg)


def main() -> None:
    from lightning_dist.lifecycle.quick_exit import exit_quickly

    try:
        _main()
    except SystemExit as leaving:
        exit_quickly(leaving.code)
    exit_quickly(0)


def _main() -> None:
    from lightning_dist._compat.hydra import hydra_args_parser, is_a_rank_lightning_started
    from lightning_dist.lifecycle.stop_signals import Stopped, end_with_launcher, leaving_as_the_stop, stop_on_signals

    args = hydra_args_parser().parse_args(sys.argv[1:])
    # First: a signal from here on ends the run and the ranks it starts (lightning_dist/lifecycle/stop_signals.py).
    job_names = [o.partition("=")[2] for o in args.overrides if o.startswith("hydra.job.name=")]
    started_by_lightning = any(is_a_rank_lightning_started(name) for name in job_names)
    stop_on_signals(quietly=started_by_lightning)
    end_with_launcher()
    try:
        with leaving_as_the_stop():
            if started_by_lightning:  # the rank that started it checked these overrides: straight to the job
                _hydra_entry()
            else:
                _check_and_run(args)
    except Stopped as stop:
        if stop.code:
            say_error(str(stop))
        raise


def _check_and_run(args: Any) -> None:
    # Checked against conf/ and the directories added to it (a recipe's); help, inspection and a replaced primary
    # config directory go straight to Hydra.
    if not (args.help or args.hydra_help or args.cfg or args.info or args.shell_completion or args.config_path):
        overrides = args.overrides
        if args.config_dir and not any(o.startswith("hydra.searchpath=") for o in overrides):
            # --config-dir adds a directory to the search path, as this override does
            overrides = [*overrides, f"hydra.searchpath=[file://{Path(args.config_dir).resolve()}]"]
        try:
            cfg = check_overrides(overrides, config_name=args.config_name or "train")
            if cfg is not None:  # a sweep's jobs are checked each in turn, when built (lightning_dist/run/compose.py)
                check_values(cfg)
            if args.multirun:  # a launcher sizes its jobs only in a sweep
                check_launcher(overrides, config_name=args.config_name or "train")
        except ConfigError as error:
            exit_with(error)
    _hydra_entry()


if __name__ == "__main__":
    main()
