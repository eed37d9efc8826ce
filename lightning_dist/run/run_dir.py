"""A run directory belongs to one run.

Users fix `hydra.run.dir` all the time (SLURM scripts do). Without a check, a second run into it replaces the first
one's `metrics.json`, `.hydra/` config and CSV, and Lightning names the newer checkpoint `last-v1.ckpt` beside the
older `last.ckpt`. So the process that starts a run claims its directory before Hydra writes anything into it:

- a directory another run has used (its claim file, `metrics.json`, or checkpoints) is refused, unless this run
  continues it on purpose (`resume=true`, `ckpt_path=`);
- the claim file is locked for the claiming process's lifetime, so two runs never share a directory at once;
- a run continued into its own directory adds to it and replaces nothing: the earlier attempt's config (`.hydra/`)
  and final metrics stay, as `.hydra.1/` and `metrics.1.json` (then `.2`, ...), and the CSV log goes on in the same
  file (lightning_dist/reports/csv_log.py).

Only the process that starts the run claims: the ranks it starts inherit its claim through the environment, and
ranks a cluster starts (torchrun, srun) leave the claim to global rank 0.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from lightning_dist.lifecycle.exits import exit_with
from lightning_dist.lifecycle.writable import unwritable_because
from lightning_dist.run.config_check import ConfigError
from lightning_dist.run.per_rank import config_subdir, launcher_ranks, log_suffix

CLAIM_FILE = ".run.lock"
# The directory this process claimed, for the processes it starts (Lightning's ranks, a sweep job's process).
CLAIM_ENV = "LIGHTNING_DIST_RUN_DIR"
# Written by each attempt of a run afresh (as is the config): an earlier attempt's is kept under a numbered name.
FINAL_METRICS = "metrics.json"
# What a run leaves that a later one must not replace (the claim file, for runs that stopped before any of them).
RESULTS = (FINAL_METRICS, "checkpoints", CLAIM_FILE)
# Where a cluster's launcher says which rank a process is; any but 0 leaves the claim to rank 0.
RANK_VARIABLES = ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK")


@dataclass
class Claim:
    directory: Path
    created: bool  # this run made the directory
    continued: bool  # it held another run, which this one continues on purpose: nothing in it is this run's alone
    lock: IO[str]  # open for the process's lifetime; the lock goes with it
    attempt_files: list[Path] = field(default_factory=list)  # what each attempt writes afresh
    set_aside: dict[Path, Path] = field(default_factory=dict)  # an earlier attempt's of them: where they were -> are
    claim_file_found: bool = False  # an earlier attempt that stopped before its results left its claim file


_claim: Claim | None = None


def current_claim() -> Claim | None:
    return _claim


def claim_run_dir(directory: Path, continuing: bool, config_dir: str | None = ".hydra") -> Claim | None:
    """Claim `directory` for this process's run, or raise ConfigError naming why not. None where another process
    (the one that started this rank) holds the claim. Continuing another run sets its attempt's `config_dir` (where
    Hydra writes the config, `hydra.output_subdir`) and final metrics aside."""
    global _claim
    directory = directory.resolve()
    if _claim is not None and _claim.directory == directory:
        return _claim
    if os.environ.get(CLAIM_ENV) == str(directory) or _started_as_another_rank():
        return None
    created = not directory.exists()
    used = [name for name in RESULTS if _holds(directory / name)]
    if (directory / CLAIM_FILE).exists():
        _refuse_if_in_use(directory)
    if used and not continuing:
        raise ConfigError(
            f"hydra.run.dir: {directory} holds another run ({', '.join(used)}); choose another directory, or continue "
            "that run on purpose with resume=true or ckpt_path=<its checkpoint>"
        )
    if why := unwritable_because(directory):
        raise ConfigError(f"hydra.run.dir: cannot write the run's directory {directory} ({why}); set paths.log_dir to a"
                          " writable directory")
    directory.mkdir(parents=True, exist_ok=True)
    claim_file_found = (directory / CLAIM_FILE).exists()
    (directory / CLAIM_FILE).touch()
    # Held open (and locked) until the process exits; read-only, as a lock needs no more: nothing of it is left for
    # the exit to write (lifecycle/quick_exit.py looks for files open for writing).
    lock = open(directory / CLAIM_FILE)  # noqa: SIM115
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # another run claimed it in the meantime
        lock.close()
        _refuse_if_in_use(directory)
        raise
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    (directory / CLAIM_FILE).write_text(json.dumps(holder))
    os.environ[CLAIM_ENV] = str(directory)
    attempt_files = [directory / name for name in (config_dir, FINAL_METRICS) if name]
    _claim = Claim(directory, created, bool(used), lock, attempt_files, claim_file_found=claim_file_found)
    if used:
        _claim.set_aside = set_aside_earlier_attempt(_claim.attempt_files)
    return _claim


def release_claim() -> None:
    """A run that finished leaves no claim behind: its results (`metrics.json`, checkpoints) say that the directory
    holds a run; the lock is let go and its file removed. A run that stopped before writing any keeps its claim file,
    which says the same."""
    global _claim
    claim = _claim
    if claim is None or not any(_holds(claim.directory / name) for name in (FINAL_METRICS, "checkpoints")):
        return
    claim.lock.close()
    (claim.directory / CLAIM_FILE).unlink(missing_ok=True)
    _claim = None


def as_before_this_attempt(path: Path) -> Path:
    """Where a file that an earlier attempt of the claimed run left at `path` is now: set aside by this attempt's
    claim (`metrics.json` -> `metrics.1.json`), or still at `path`."""
    return _claim.set_aside.get(path.resolve(), path) if _claim is not None else path


def set_aside_earlier_attempt(paths: list[Path]) -> dict[Path, Path]:
    """Rename those of `paths` an earlier attempt left to the first number free for all of them (`.hydra.1`,
    `metrics.1.json`), so that the attempts' files pair up; returns where each went."""
    present = [path for path in paths if path.exists()]
    number = 1
    while any(_numbered(path, number).exists() for path in present):
        number += 1
    moved = {path: _numbered(path, number) for path in present}
    for path, aside in moved.items():
        path.rename(aside)
    return moved


def _numbered(path: Path, number: int) -> Path:
    stem, suffix = (path.name, "") if path.name.startswith(".") else (path.stem, path.suffix)
    return path.with_name(f"{stem}.{number}{suffix}")


def discard_refused_run(directory: Path, job_name: str) -> None:
    """A run refused before it started leaves nothing: what Hydra and the claim wrote for it (`.hydra/`, the job's
    log, the claim file) goes, and the directory too when this run made it. A directory that holds anything else
    stays as it was; a run continued on purpose gets back the files set aside for this attempt."""
    claim = current_claim()
    if claim is not None:
        claim.lock.close()
        if claim.continued:
            for path in claim.attempt_files:  # the refused attempt's
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
            for path, aside in claim.set_aside.items():
                aside.rename(path)
            if not claim.claim_file_found:
                (claim.directory / CLAIM_FILE).unlink(missing_ok=True)
            return
    rank, _, _ = launcher_ranks()
    if (
        rank != 0
    ):  # a cluster's launcher started this rank: its log and its node's config are its own, the rest rank 0's
        _remove(directory / f"{job_name}{log_suffix()}.log")
        if (node_config := config_subdir()) is not None:
            _remove(directory / node_config)
        return
    ours = {".hydra", f"{job_name}.log", CLAIM_FILE}
    if not directory.is_dir() or not {entry.name for entry in directory.iterdir()} <= ours:
        return
    if claim is None or claim.created:
        shutil.rmtree(directory)
        _remove_empty_parents(directory)
        return
    for entry in directory.iterdir():
        _remove(entry)


def _remove_empty_parents(directory: Path) -> None:
    """The parents the run's directory left empty (`logs/train/runs/`), up to the working directory: a run that
    leaves nothing leaves no empty folders either."""
    working = Path.cwd().resolve()
    for parent in directory.resolve().parents:
        if parent == working or working not in parent.parents:
            return
        try:
            parent.rmdir()  # only an empty one
        except OSError:
            return


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _refuse_if_in_use(directory: Path) -> None:
    with open(directory / CLAIM_FILE) as claim:
        try:
            fcntl.flock(claim, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe_holder(claim.read())
            raise ConfigError(
                f"hydra.run.dir: {directory} is in use by a run still going ({holder}); choose another directory"
            ) from None


def _holds(path: Path) -> bool:
    return path.is_file() or (path.is_dir() and any(path.iterdir()))


def _started_as_another_rank() -> bool:
    return any(os.environ.get(name, "0") not in ("", "0") for name in RANK_VARIABLES)


def _describe_holder(text: str) -> str:
    try:
        holder = json.loads(text)
        return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
    except (ValueError, KeyError, TypeError):
        return "its claim file is locked"


class OneRunPerDirectory(Callback):
    """Hydra callback (conf/train.yaml, `hydra.callbacks`): claims `hydra.run.dir` before Hydra writes into it, and
    refuses a sweep whose directory cannot be written before Hydra tries."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        directory = Path(str(config.hydra.sweep.dir)).absolute()
        if why := unwritable_because(directory):
            exit_with(ConfigError(f"hydra.sweep.dir: cannot write the sweep's directory {directory} ({why}); set"
                                  " paths.log_dir to a writable directory"))

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.core.hydra_config import HydraConfig

        HydraConfig.instance().set_config(config)  # as Hydra's run_job does next, for `${hydra:...}` in the path
        continuing = bool(config.get("resume")) or bool(config.get("ckpt_path"))
        try:
            claim_run_dir(Path(str(config.hydra.run.dir)), continuing, config.hydra.output_subdir)
        except ConfigError as error:
            exit_with(error)


def discard_this_run_of_the_job() -> None:
    """`discard_refused_run` for the run this process is in, once another rank refused it: from anywhere (a thread
    that ends the process while the process group forms), nothing if Hydra has not started the run."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.RUN:
        config = HydraConfig.get()
        discard_refused_run(Path(config.runtime.output_dir), config.job.name)
