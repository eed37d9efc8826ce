"""Each job of a Hydra sweep in a process of its own, so that multi-process strategies work in sweeps.

Lightning starts ranks 1..N-1 by re-running rank 0's command line. In a sweep run by Hydra's basic launcher,
rank 0 is the sweep's own interpreter and its command line is the sweep (`-m strategy=ddp,fsdp`): every child
re-runs the whole sweep into a directory of its own; a rank that dies takes the sweep down with it (Lightning's
observer kills rank 0); the next job inherits the port and the process group. Running the job as
`python run_job.py <the job's own overrides> hydra.run.dir=<the job's directory>` gives its ranks a
clean command line and one directory, and gives the job a process whose exit code is its result.

A job of one process (one device, one node) starts no ranks: it runs in the sweep's interpreter, as Hydra's basic
launcher intends, and `train()` leaves no process group or port behind for the next job.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

from hydra.types import RunMode
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

from lightning_dist.lifecycle.stop_signals import Stopped

log = logging.getLogger(__name__)

# The job process logs to `<job dir>/job.log`; the sweep keeps `<job dir>/<task>.log` for its own lines.
JOB_LOG_NAME = "job"
JOB_SCRIPT = Path(__file__).with_name("run_job.py")


class JobFailed(RuntimeError):
    """A sweep job whose process exited non-zero; Hydra records it and runs the remaining jobs."""


def needs_isolation(hydra_config: Any, trainer_config: Any) -> bool:
    """A sweep job that Lightning would start ranks for, unless a cluster (SLURM tasks, torchrun) started them."""
    if hydra_config.mode != RunMode.MULTIRUN or SLURMEnvironment.detect() or TorchElasticEnvironment.detect():
        return False
    return not _one_process(trainer_config.get("devices"), trainer_config.get("num_nodes", 1))


def _one_process(devices: Any, num_nodes: Any) -> bool:
    if str(num_nodes) != "1":
        return False
    if not isinstance(devices, (str, int)) and hasattr(devices, "__len__"):
        return len(devices) == 1  # explicit device ids: [0]
    return str(devices).strip() in ("1", "0,")  # "auto" and -1 may mean several: isolate


def job_command(hydra_config: Any) -> list[str]:
    """The job alone: its config, its own overrides (no sweep syntax), its directory."""
    output_dir = hydra_config.runtime.output_dir
    command = [sys.executable, str(JOB_SCRIPT), f"--config-name={hydra_config.job.config_name}"]
    for source in hydra_config.runtime.config_sources:
        if source.provider == "command-line":  # --config-dir given to the sweep
            command.append(f"--config-dir={source.path.removeprefix('file://')}")
    return [
        *command,
        *hydra_config.overrides.task,
        "hydra.mode=RUN",  # one run, even when the config asks for a sweep (hparams_search sets hydra.mode)
        f"hydra.run.dir={output_dir}",
        f"hydra.job.name={JOB_LOG_NAME}",
        "hydra.output_subdir=null",  # the sweep has written the job's .hydra/ already
    ]


def run_isolated(hydra_config: Any) -> dict[str, float]:
    """Run the job in a child process; its final metrics, or JobFailed naming the job and its log."""
    command = job_command(hydra_config)
    number, overrides = hydra_config.job.num, " ".join(hydra_config.overrides.task)
    log.info(f"Job {number} ({overrides}) in its own process")
    process = subprocess.Popen(command, cwd=hydra_config.runtime.cwd)
    try:
        returncode = process.wait()
    except Stopped as stopped:
        # Passed on, the job stops as it would on its own: before training at once, in training after saving.
        process.send_signal(stopped.signum)
        process.wait()
        raise
    output_dir = Path(hydra_config.runtime.output_dir)
    if returncode:
        raise JobFailed(
            f"job {number} ({overrides}) exited with code {returncode}; its log: {output_dir / (JOB_LOG_NAME + '.log')}"
        )
    summary = output_dir / "metrics.json"
    return json.loads(summary.read_text()).get("metrics", {}) if summary.exists() else {}
