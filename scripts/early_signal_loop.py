"""SIGTERM (or SIGINT) to `python train.py` at odd moments of its start: every process of the run must be gone within
30 s, with the documented exit code (75; 130 for SIGINT; 0 if the run finished first).

    python -m scripts.early_signal_loop                              # ddp, fsdp, deepspeed_stage_2; 1, 3, 5 s; 5 each
    python -m scripts.early_signal_loop --strategies ddp --delays 2 --repeats 20 --signal SIGINT

Each run starts in a fresh working directory; its processes are found by it (Lightning starts the ranks where the
run started). Prints one line per run and a table of outcomes; exits 1 if any run
left a process behind or exited with another code.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CODES = {"SIGTERM": 75, "SIGINT": 130, "SIGKILL": -9}  # SIGKILL: no handler; the ranks must die with it
GONE_WITHIN_S = 30.0


def processes_in(directory: str) -> list[int]:
    """The processes working in `directory`: a run's, whose ranks Lightning starts where the run started."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.readlink(entry / "cwd") == directory:
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


@dataclass
class Outcome:
    code: int  # the launching process's exit code (negative: killed by that signal)
    gone_after_s: float  # from the signal until no process of the run remained
    left: list[int]  # pids still there GONE_WITHIN_S after the signal (then killed)
    stderr: str


def one_run(strategy: str, delay_s: float, signum: signal.Signals, python: str = sys.executable) -> Outcome:
    """`python train.py strategy=<strategy>` in a fresh directory, sent `signum` `delay_s` after it started."""
    with tempfile.TemporaryDirectory(prefix="early_signal_") as work, tempfile.TemporaryFile("w+") as stderr:
        work = os.path.realpath(work)
        # stderr to a file: the ranks inherit it, and a pipe would stay open for as long as any of them lives.
        process = subprocess.Popen([python, str(REPO / "train.py"), f"strategy={strategy}", "trainer.max_steps=20"],
                                   cwd=work, stdout=subprocess.DEVNULL, stderr=stderr, text=True)
        time.sleep(delay_s)
        process.send_signal(signum)
        signalled = time.monotonic()
        try:
            process.wait(timeout=GONE_WITHIN_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        while processes_in(work) and time.monotonic() - signalled < GONE_WITHIN_S:
            time.sleep(0.2)
        gone_after = time.monotonic() - signalled
        left = processes_in(work)
        for pid in left:  # leave the machine clean for the next run
            with suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        stderr.seek(0)
        return Outcome(process.returncode, gone_after, left, stderr.read())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", nargs="+", default=["ddp", "fsdp", "deepspeed_stage_2"])
    parser.add_argument("--delays", nargs="+", type=float, default=[1.0, 3.0, 5.0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--signal", choices=sorted(CODES), default="SIGTERM")
    args = parser.parse_args(argv)
    signum = signal.Signals[args.signal]
    outcomes: Counter[tuple[str, float, str]] = Counter()
    bad = 0
    for strategy in args.strategies:
        for delay in args.delays:
            for attempt in range(args.repeats):
                run = one_run(strategy, delay, signum)
                ok = not run.left and run.code in (CODES[args.signal], 0) and "Traceback" not in run.stderr
                bad += not ok
                outcomes[(strategy, delay, f"exit {run.code}" + (f", {len(run.left)} left" if run.left else ""))] += 1
                print(f"{strategy:>18} {delay:4.1f} s #{attempt}: exit {run.code}, all gone {run.gone_after_s:4.1f} s"
                      f" after the signal{'' if ok else '  <-- FAIL'}", flush=True)
                if not ok:
                    print("    " + "\n    ".join(run.stderr.strip().splitlines()[-25:]), flush=True)
    print("\n| strategy | delay (s) | outcome | runs |\n|---|---|---|---|")
    for (strategy, delay, outcome), count in sorted(outcomes.items()):
        print(f"| {strategy} | {delay:g} | {outcome} | {count} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
