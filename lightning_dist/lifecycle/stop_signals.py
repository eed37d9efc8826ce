"""Signals at any moment: a run told to stop before its first step (or by Ctrl-C) ends at once, every process of it.

The preemption callback (callbacks/preemption.py) turns SIGTERM during training into a checkpoint and exit 75, but
only once training runs. Before that (imports, set-up, starting the ranks, compiling DeepSpeed's ops: seconds to
minutes) SIGTERM killed the launching process by its default action, and the ranks it had started, re-parented to
init, waited in a collective for the whole timeout (30 minutes by default), each holding its GPU.

- `stop_on_signals()`, first thing in `train.py`: SIGTERM, SIGUSR1, SIGUSR2 (what schedulers send) and SIGINT
  (Ctrl-C) are passed on to the ranks this process started, and end this one with `Stopped`: 75 (not finished, run
  the same command again) or 130 for Ctrl-C. Python runs a signal handler only between two bytecodes of the main
  thread, which may be blocked in native code (a rendezvous waiting for a rank that is gone); so a thread woken by
  the signal itself passes it on at once and ends the process if the main thread has not left once the ranks it
  started are gone, or after `STOP_GRACE_S`. A rank that dies of the signal passed on, seen first by Lightning's
  observer of the ranks, ends the job as the stop too (strategies/launcher.py).
- `end_with_launcher()`, in each rank another process of the run started: the kernel kills it when that process
  dies, however it died, SIGKILL included (Linux's PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

from lightning_dist.lifecycle.error_line import say_error

# Exit codes: 75 is sysexits.h EX_TEMPFAIL, as for a preemption (callbacks/preemption.py); 130 is a shell's code for
# a process ended by Ctrl-C.
STOP_CODES = {signal.SIGTERM: 75, signal.SIGUSR1: 75, signal.SIGUSR2: 75, signal.SIGINT: 130}
# How long the main thread has to leave on its own once told (it passes the signal on and cleans up), before the
# process is ended without it.
STOP_GRACE_S = 10.0
_LEAVING_S = 1.0  # what a main thread that runs needs to leave once the ranks it started are gone
_ASK_AGAIN_S = 0.05  # when the signal came at a moment to raise nothing (`_not_here`)
# The standard library's weakref callbacks that run often: the import system's module locks, weak dictionaries.
_WEAKREF_CALLBACKS = {("cb", "<frozen importlib._bootstrap>"), ("remove", weakref.__file__)}
# How long a launcher leaving normally waits for the ranks it started (see `_wait_for_started`).
CHILD_EXIT_WAIT_S = 15.0
# The pid of the process that started this rank, set by that process for the ranks it starts.
LAUNCHER_ENV = "LIGHTNING_DIST_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1
_TORCHRUN_WORKER = "TORCHELASTIC_RUN_ID"  # set by torchrun's agent for the workers it starts

_received: int | None = None  # the first stop signal this process's handler got
_signalled: int | None = None  # the first that arrived, as the watcher thread saw it: the handler may not have run
_quiet = False  # a rank Lightning started: its launcher reports the stop; a non-zero exit would get it SIGKILLed
_STOP_NUMBERS = {int(signum) for signum in STOP_CODES}
_passed_on: set[int] = set()
_backed_up: set[int] = set()  # signals whose grace thread runs (`_watch`)
_waiting_at_exit: list[Callable[[], list[Any]]] = []  # the latest launch's processes, waited for at exit
_started: list[Callable[[], list[Any]]] = []  # how to find the processes this one started (a launcher's `procs`)


class Stopped(SystemExit):
    """This process was told to stop by a signal; a SystemExit, so that nothing on the way mistakes it for a failure
    to report."""

    def __init__(self, signum: int) -> None:
        super().__init__(0 if _quiet else STOP_CODES[signal.Signals(signum)])
        self.signum = signum

    def __str__(self) -> str:
        return f"stopped by {signal.Signals(self.signum).name}, and the ranks it started with it; {_what_is_kept()}"


# Says what a stop leaves to resume from, once a run knows where it saves (`say_what_a_stop_keeps`).
_describe_kept: list[Callable[[], str | None]] = []
_KEPT_UNKNOWN = "checkpoints saved before it are kept (resume=true continues from the newest)"


def say_what_a_stop_keeps(describe: Callable[[], str | None] | None) -> None:
    """The stop line names what the run kept: `describe()`'s words (None from it, or no `describe`: said in
    general)."""
    _describe_kept[:] = [describe] if describe is not None else []


def _what_is_kept() -> str:
    try:
        return (_describe_kept[0]() if _describe_kept else None) or _KEPT_UNKNOWN
    except Exception:  # a stop line must be said whatever the checkpoints hold
        return _KEPT_UNKNOWN


def stop_on_signals(quietly: bool = False) -> None:
    """Install the handlers and the thread that backs them up; call once, from the main thread. `quietly`: this
    process is a rank whose launcher speaks for the run (its exit code is 0; see `Stopped.code`)."""
    global _quiet
    _quiet = quietly
    if signal.getsignal(signal.SIGTERM) is _stop:
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end)  # the interpreter writes each signal's number here as it arrives
    for signum in STOP_CODES:
        signal.signal(signum, _stop)
    threading.Thread(target=_watch, args=(read_end,), name="stop-on-signals", daemon=True).start()


@contextmanager
def passing_signals_to(find_processes: Callable[[], list[Any]]) -> Iterator[None]:
    """Within: a signal that stops this process is passed on to `find_processes()` (subprocess.Popen or
    multiprocessing.Process objects) first; the ranks started here end if this process dies (`end_with_launcher`),
    and this process waits for them when it leaves normally, up to `CHILD_EXIT_WAIT_S`."""
    _started.append(find_processes)
    if not _waiting_at_exit:
        _waiting_at_exit.append(find_processes)
        atexit.register(_wait_for_started)
    _waiting_at_exit[0] = find_processes
    previous = os.environ.get(LAUNCHER_ENV)
    os.environ[LAUNCHER_ENV] = str(os.getpid())
    try:
        yield
    finally:
        _started.remove(find_processes)
        if previous is None:
            os.environ.pop(LAUNCHER_ENV, None)
        else:
            os.environ[LAUNCHER_ENV] = previous


def _wait_for_started() -> None:
    """At exit: the ranks this process started are past the run's last collective and leaving too; a launcher that
    left first would take them with it before they finish (their logs, their process group's close)."""
    deadline = time.monotonic() + CHILD_EXIT_WAIT_S
    for process in _waiting_at_exit[0]() or []:
        with suppress(Exception):
            if hasattr(process, "wait"):
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            else:
                process.join(max(0.0, deadline - time.monotonic()))


def end_with_launcher() -> None:
    """In a rank another process of the run started: SIGKILL when that process dies. Not a signal to handle: the
    rank may be blocked in native code that holds the GIL (a rendezvous retrying to reach the dead process), where
    no Python handler runs, for the whole timeout. Its launcher waits for it when leaving normally
    (`passing_signals_to`), so only a launcher that died takes its ranks with it. A worker torchrun's agent started
    has that agent for its launcher: torchrun starts each worker in a session of its own, and an agent killed with
    SIGKILL left its worker training alone, waiting in collectives for the others until the timeout."""
    launcher = int(os.environ.get(LAUNCHER_ENV, os.getppid() if _TORCHRUN_WORKER in os.environ else os.getpid()))
    if launcher == os.getpid() or not sys.platform.startswith("linux"):
        return
    if os.getppid() == launcher:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() == launcher:
            return
    # Not (or no longer) its child. A process forked from a warm interpreter (our test suite's) has another parent,
    # which passes the launcher's death on itself; one whose launcher died before it got here has been re-parented.
    if not process_alive(launcher):
        os.kill(os.getpid(), signal.SIGKILL)


def process_alive(pid: int) -> bool:
    """Whether `pid` runs: a process that died but was not yet reaped by its parent (a zombie) does not."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _stop(signum: int, frame: Any) -> None:
    global _received
    _pass_on(signum)
    if _quiet or _received is not None:  # a rank whose launcher speaks for it, or told twice: nothing to wait for
        end_now(signum)
    if _not_here(frame):
        timer = threading.Timer(_ASK_AGAIN_S, os.kill, args=(os.getpid(), signum))
        timer.daemon = True
        timer.start()
        return
    _received = signum
    raise Stopped(signum)


def _not_here(frame: Any) -> bool:
    """Whether an exception raised at `frame` would be lost, so the stop is asked again in a moment: inside a
    destructor or a weakref callback Python prints it ("Exception ignored in ...") and goes on. Seen: in the import
    system's module-lock callback, which left numpy.linalg half imported (a RecursionError at its next use)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or (code.co_name, code.co_filename) in _WEAKREF_CALLBACKS:
            return True
        frame = frame.f_back
    return False


def stopped() -> Stopped | None:
    """The stop this process was told, if any: an exception on its way out after a signal may be another one,
    raised by code the signal interrupted midway."""
    signum = _received or _signalled
    return None if signum is None else Stopped(signum)


@contextmanager
def leaving_as_the_stop() -> Iterator[None]:
    """Within: after a stop signal, whatever leaves leaves as the stop (`Stopped`). Code the signal interrupted
    midway may fail on its way out, or later, with an error of its own: a module half imported when the signal
    came, and the stop swallowed by a library's catch-all, fails at its next use (seen: a RecursionError in numpy's
    `__getattr__`). Its traceback, printed by Hydra or our own error lines, would read as the run's fault."""
    try:
        yield
    except BaseException as error:
        stop = stopped()
        if stop is None or isinstance(error, Stopped):
            raise
        raise stop from error


def _pass_on(signum: int) -> None:
    """Once per signal, whether the handler or the thread gets there first: a rank that already runs the preemption
    callback takes a second SIGTERM as "die now"."""
    if signum in _passed_on:
        return
    _passed_on.add(signum)
    for find_processes in list(_started):
        for process in find_processes() or []:
            with suppress(OSError, ValueError, AttributeError):
                if isinstance(getattr(process, "pid", None), int) and _running(process):
                    os.kill(process.pid, signum)


def _running(process: Any) -> bool:
    poll = getattr(process, "poll", None)  # subprocess.Popen
    return poll() is None if poll is not None else process.is_alive()


def _watch(read_end: int) -> None:
    global _signalled
    while True:
        numbers = os.read(read_end, 64)
        for number in numbers:
            if number not in _STOP_NUMBERS or signal.getsignal(number) is not _stop or number in _backed_up:
                continue  # in training the preemption callback has SIGTERM, and needs the time; asked again: running
            _backed_up.add(number)
            _signalled = _signalled or number
            _pass_on(number)
            # Daemon: the process may end sooner, on its own.
            threading.Thread(target=_end_unless_left, args=(number,), name="stop-grace", daemon=True).start()


def _end_unless_left(signum: int) -> None:
    """End the process if the main thread has not left within `STOP_GRACE_S`, or soon after the ranks it started
    are gone: a main thread blocked in native code waiting for them (a rendezvous) would wait for its timeout."""
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline:
        time.sleep(0.2)
        started = [process for find in list(_started) for process in find() or []]
        if started and not any(_running(process) for process in started):
            time.sleep(_LEAVING_S)  # the main thread's own way out, if it is running
            break
    end_now(signum)


def end_now(signum: int) -> None:
    """End the process now, without the main thread (it did not leave within the grace, or there is nothing to
    wait for): the line first, flushed, as nothing else will be."""
    stopped = Stopped(signum)
    if stopped.code:
        say_error(str(stopped))
    os._exit(int(stopped.code or 0))
