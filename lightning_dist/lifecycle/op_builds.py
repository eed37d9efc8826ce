"""No silent minute while DeepSpeed's native ops load: what a first use compiles (minutes, with no output of its own),
and any wait on another process's build, said as it starts.

- Before a compile: one line naming the op, what it is for, where it is cached, and how long its last build on this
  machine took.
- A load still waiting after 5 s (on another process's build, or this one's compile) says so, naming the process
  that holds the build lock, then again each minute.
- Each environment keeps its own op cache: where TORCH_EXTENSIONS_DIR is unset, a venv's (or conda env's) ops are
  compiled into `<env>/torch_extensions`. torch's default, one `~/.cache/torch_extensions` for the whole machine,
  holds build files that name one environment's include paths: a second venv rebuilt the first's `cpu_adam` there,
  and the first's next run then waited minutes, silent, on that build's lock.
- Each environment builds with its own ninja (the `ninja` package beside its Python), whatever PATH says: ninja
  1.11 (a system's) and 1.13 (PyPI's) read each other's build log as out of date and compile the whole op again,
  so an op built ahead of time (`lightning-dist prepare` run without the venv activated, as CI's compatibility tier
  did) was compiled again by the first run that had the venv on its PATH: 2-3 minutes of both cores, each time.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from lightning_dist.lifecycle.op_build_lock import clear_abandoned, lock_holder

# What each op DeepSpeed may compile on our strategies' runs is for, as the announcement says it.
OP_PURPOSES = {"cpu_adam": "optimizer offload (DeepSpeed's CPU Adam)", "async_io": "NVMe offload",
               "cpu_adagrad": "DeepSpeed's CPU Adagrad", "cpu_lion": "DeepSpeed's CPU Lion"}
FIRST_NOTICE_S = 5.0  # a wait on another process's build is said this soon
CACHED_NOTICE_S = 30.0  # a cached op's load, which takes seconds on a loaded machine, this late
REPEAT_NOTICE_S = 60.0


def announce_op_builds(say: Callable[[str], None]) -> None:
    """From now on in this process, every first load of a DeepSpeed native op is said as described above (a lock a
    process that ended left behind is removed first, and said so). Idempotent."""
    from lightning_dist._compat.deepspeed import around_op_loads

    keep_op_cache_in_this_environment()
    build_with_this_environments_ninja()
    around_op_loads(lambda name: _said_around_load(name, say))


def keep_op_cache_in_this_environment() -> Path | None:
    """Point TORCH_EXTENSIONS_DIR at this venv's or conda env's own directory, where it is unset and the environment
    can be written to; the directory, or None where the setting stays as it was. The ranks a process starts inherit
    it."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return None
    in_an_environment = sys.prefix != sys.base_prefix or os.environ.get("CONDA_PREFIX") == sys.prefix
    if not in_an_environment or not os.access(sys.prefix, os.W_OK):
        return None
    directory = Path(sys.prefix) / "torch_extensions"
    os.environ["TORCH_EXTENSIONS_DIR"] = str(directory)
    return directory


def build_with_this_environments_ninja() -> Path | None:
    """Put the directory of this environment's `ninja` first on PATH (torch's extension builds run `ninja` from
    PATH), where it has one and PATH would find another first; that directory, or None where nothing changed. The
    ranks a process starts inherit it. Found from the environment's prefix, not from `sys.executable`, which a
    launcher may have replaced (our suite's warm Python did: its op builds then ran the system's ninja)."""
    import shutil

    own = Path(sys.prefix) / "bin" / "ninja"
    if not own.is_file() or not os.access(own, os.X_OK):
        return None
    found = shutil.which("ninja")
    if found is not None and Path(found).resolve() == own.resolve():
        return None
    os.environ["PATH"] = os.pathsep.join([str(own.parent), os.environ.get("PATH", "")])
    return own.parent


@contextmanager
def _said_around_load(name: str, say: Callable[[str], None]) -> Iterator[None]:
    from lightning_dist._compat.deepspeed import op_build_directory, op_is_built
    from lightning_dist._compat.torch import extension_build_lock

    directory = op_build_directory(name)
    if lock := extension_build_lock(directory):
        clear_abandoned(lock, say)
    compiling = not op_is_built(name)
    last = last_build_seconds(name)
    if compiling:
        took = f"{last:.0f} s the last time on this machine" if last else "a few minutes"
        say(f"DeepSpeed is compiling its {name} op for {OP_PURPOSES.get(name, 'this run')}: once per environment"
            f" ({took}), cached in {directory}; `lightning-dist prepare` does it ahead of time")
    started = time.monotonic()
    done = threading.Event()
    notices = threading.Thread(target=_say_while_waiting, args=(name, directory, compiling, started, done, say),
                               daemon=True)
    notices.start()
    try:
        yield
    finally:
        done.set()
    if compiling and op_is_built(name):
        _remember_build_seconds(name, time.monotonic() - started)


def _say_while_waiting(name: str, directory: Path, compiling: bool, started: float, done: threading.Event,
                       say: Callable[[str], None]) -> None:
    """Every 5 s, until the load ends: a wait on another process's lock is said at once (then each minute); this
    process's own compile each minute (its first line said it); a load of a cached op after 30 s, as torch then
    compiles it again (its sources or flags changed) or the machine is that loaded."""
    said_at = started
    while not done.wait(FIRST_NOTICE_S):
        now = time.monotonic()
        elapsed, quiet = now - started, now - said_at
        holder, first = lock_holder(directory / "lock"), said_at == started
        if holder not in (None, os.getpid()):
            due = first or quiet >= REPEAT_NOTICE_S
            line = (f"still loading DeepSpeed's {name} op after {elapsed:.0f} s: waiting on process {holder}, which"
                    f" holds its build lock in {directory} (it compiles or checks the op)")
        elif compiling:
            due = quiet >= REPEAT_NOTICE_S
            line = f"still compiling DeepSpeed's {name} op: {elapsed:.0f} s so far, into {directory}"
        else:
            due = quiet >= (CACHED_NOTICE_S if first else REPEAT_NOTICE_S)
            line = (f"still loading DeepSpeed's {name} op after {elapsed:.0f} s from {directory}: torch is checking"
                    " it, or compiling it again where its sources or compile flags changed")
        if due:
            say(line)
            said_at = now


def _times_file() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "lightning_dist" / "op_build_seconds.json"


def last_build_seconds(name: str) -> float | None:
    """How long the last build of op `name` on this machine took, in any environment (None before the first)."""
    try:
        return float(json.loads(_times_file().read_text())[name])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _remember_build_seconds(name: str, seconds: float) -> None:
    path = _times_file()
    try:
        times = json.loads(path.read_text()) if path.is_file() else {}
        times[name] = round(seconds, 1)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(times))
    except (OSError, ValueError):  # a read-only home: the next announcement says "a few minutes" instead
        pass
