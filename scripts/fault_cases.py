"""The fault loop's other cases, each run as users run `train.py` and checked by what they see: an early stop, the
metrics rows of a stopped and resumed run, checkpoints the run cannot read, a rank killed or stopped mid-run.

    python -m scripts.fault_cases --workdir /tmp/fault_cases          # every case (about 8 minutes on 2 cores)
    python -m scripts.fault_cases --workdir /tmp/fault_cases --only unreadable

The unreadable cases run `train.py` as the unprivileged user `nobody` (setpriv; we run as root, whom permission bits
do not stop). Prints one row per check and the counts; exit 1 if any failed. The suite holds the scaled-down checks
(tests/callbacks/test_model_checkpoint.py, tests/checkpoints/test_unreadable_checkpoints.py,
tests/strategies/test_failed_rank_exit.py); this is the long version, with real permissions and a stopped rank.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
SHORT = ("trainer.max_steps=12", "test=false", "callbacks.model_checkpoint.every_n_train_steps=5",
         "callbacks.model_checkpoint.save_top_k=-1", "callbacks.model_checkpoint.monitor=null")

Check = tuple[str, bool, str]  # what was checked, whether it held, what was seen


def train(run_dir: Path, *overrides: str, as_nobody: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "train.py"), f"hydra.run.dir={run_dir}", *overrides]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore::DeprecationWarning"}
    if as_nobody:
        # The system's interpreter of the same version, with this environment's packages: a virtual environment's
        # interpreter may be a link into root's home, which `nobody` cannot enter (the ranks it starts would fail).
        system_python = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
        if not system_python.is_file():
            raise SystemExit(f"the unreadable cases run train.py as nobody with {system_python}, which is missing")
        command = [*NOBODY, str(system_python), *command[1:]]
        env = {**env, "HOME": str(run_dir.parent), "PYTHONPATH": f"{REPO}:{sysconfig.get_paths()['purelib']}"}
    return subprocess.run(command, cwd=run_dir.parent, capture_output=True, text=True, timeout=timeout, env=env)


def error_lines(process: subprocess.CompletedProcess) -> list[str]:
    return [line[line.index("error: "):] for line in (process.stdout + process.stderr).splitlines() if "error: " in line]


def csv_losses(run_dir: Path) -> dict[str, str]:
    with open(run_dir / "csv" / "metrics.csv") as file:
        return {row["step"]: row["train_loss"] for row in csv.DictReader(file) if row.get("train_loss")}


def early_stops(work: Path) -> list[Check]:
    """SIGINT and SIGTERM at step 53, before the first validation (step 100): `last` of step 50 kept (the preemption
    saves its own step), the stop line names it, and the resumed run's metrics.csv equals the uninterrupted one's."""
    checks: list[Check] = []
    base = ("trainer.max_steps=60", "test=false")
    uninterrupted = work / "uninterrupted"
    done = train(uninterrupted, *base)
    checks.append(("uninterrupted run", done.returncode == 0, f"exit {done.returncode}"))
    for signal_name, code, kept_at in (("SIGINT", 130, 50), ("SIGTERM", 75, 55)):
        run_dir = work / signal_name
        stopped = train(run_dir, *base, "+callbacks.stop._target_=tests.probes.SignalAtStep",
                        "+callbacks.stop.global_step=53", f"+callbacks.stop.signal={signal_name}")
        said = error_lines(stopped)[-1:] or [(stopped.stderr.strip().splitlines() or [""])[-1]]
        named = f"at step {kept_at}" in said[0] or f"global step {kept_at}" in said[0]
        checks.append((f"{signal_name} at step 53: exit {code}, the line names what it kept",
                       stopped.returncode == code and named, f"exit {stopped.returncode}: {said[0][:160]}"))
        resumed = train(run_dir, *base, "resume=run_dir")
        rows_equal = resumed.returncode == 0 and csv_losses(run_dir) == csv_losses(uninterrupted)
        checks.append((f"{signal_name}: resumed, metrics.csv rows equal the uninterrupted run's", rows_equal,
                       f"exit {resumed.returncode}"))
    return checks


def unreadable(work: Path) -> list[Check]:
    """As `nobody`: the newest checkpoints unreadable (chmod 000) are passed over by resume=true for an older whole
    one; as ckpt_path one is refused in one line; a sharded `last` this user cannot empty stays, and saves go on."""
    checks: list[Check] = []
    work.chmod(0o777)
    run_dir = work / "ddp"
    first = train(run_dir, *SHORT, "trainer.max_steps=10", as_nobody=True)
    checks.append(("a run as nobody", first.returncode == 0, f"exit {first.returncode}"))
    checkpoints = run_dir / "checkpoints"
    for name in ("last.ckpt", "step000010.ckpt"):
        (checkpoints / name).chmod(0)
    resumed = train(run_dir, *SHORT, "resume=run_dir", as_nobody=True)
    output = resumed.stdout + resumed.stderr
    passed = re.findall(r"passed over \S+: it cannot be read \(Permission denied", output)
    checks.append(("resume=run_dir passes over the 2 unreadable ones, resumes from step 5",
                   resumed.returncode == 0 and len(passed) == 2 and f"resuming from {checkpoints}/step000005.ckpt" in output,
                   f"exit {resumed.returncode}, passed over {len(passed)}"))
    (checkpoints / "last.ckpt").chmod(0)  # the resumed run saved a readable one in its place
    refused = train(work / "refused", *SHORT, f"ckpt_path={checkpoints}/last.ckpt", as_nobody=True)
    lines = error_lines(refused)
    checks.append(("ckpt_path= an unreadable one: one line, exit 2",
                   refused.returncode == 2 and len(lines) == 1 and "cannot be read (Permission denied" in lines[0],
                   f"exit {refused.returncode}: {lines[:1]}"))
    sharded = work / "fsdp"
    first = train(sharded, "strategy=fsdp", *SHORT, "trainer.max_steps=5", as_nobody=True)
    last = sharded / "checkpoints" / "last.ckpt"
    last.chmod(0o500)  # its files cannot be removed: the directory set aside by the next save stays
    again = train(sharded, "strategy=fsdp", *SHORT, "resume=run_dir", as_nobody=True)
    last.with_name(".last.ckpt.previous").chmod(0o755) if last.with_name(".last.ckpt.previous").exists() else None
    checks.append(("a sharded last that cannot be emptied: the saves go on, exit 0",
                   first.returncode == 0 and again.returncode == 0, f"exit {first.returncode}, {again.returncode}:"
                   f" {error_lines(again)[:1]}"))
    return checks


def dead_ranks(work: Path) -> list[Check]:
    """Three ranks: rank 2 SIGKILLed at step 3 is named first with its signal; rank 2 SIGSTOPped is named where the
    others time out (strategy.timeout=30)."""
    checks: list[Check] = []
    for signal_name, extra, expected in (
        ("SIGKILL", (), r"rank 2 \(pid \d+ on \S+\) was killed by SIGKILL"),
        ("SIGSTOP", ("strategy.timeout=30",), r"longer than strategy.timeout=30 s: rank 2 \(pid \d+ on \S+\) is stopped"),
    ):
        run = train(work / signal_name, "trainer.devices=3", "trainer.max_steps=10", "test=false", *extra,
                    "+callbacks.kill._target_=tests.probes.SignalAtStep", "+callbacks.kill.global_step=3",
                    f"+callbacks.kill.signal={signal_name}", "+callbacks.kill.rank=2")
        lines = error_lines(run)
        checks.append((f"rank 2 {signal_name}: the first line names it", bool(lines and re.search(expected, lines[0])),
                       f"exit {run.returncode}: {(lines or [''])[0][:160]}"))
    return checks


CASES: dict[str, Callable[[Path], list[Check]]] = {
    "early_stop": early_stops, "unreadable": unreadable, "dead_rank": dead_ranks,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--only", choices=list(CASES), action="append")
    args = parser.parse_args(argv)
    print("| case | check | held | seen |\n|---|---|---|---|")
    held = failed = 0
    for name in args.only or list(CASES):
        work = args.workdir / name
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        for check, ok, seen in CASES[name](work):
            held, failed = held + ok, failed + (not ok)
            print(f"| {name} | {check} | {'yes' if ok else 'NO'} | {seen} |", flush=True)
    print(f"\n{held} held, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
