"""A warm Python for the suite: every `python ...` the tests start (and every rank those start) is forked from one
process that has already imported torch, DeepSpeed, Hydra and torchmetrics, instead of importing them again.

About 200 training runs start two interpreters each; the imports alone take about 5 s of each (measured on our
2-core machines), a third of the suite. Nothing of ours, and not Lightning, is imported before the fork: every run
still imports lightning_dist, Lightning, its configs and the user's modules exactly as a fresh interpreter would.

How: the suite's `sys.executable` becomes a small launcher script (`LAUNCHER`, standard library only, no `site`).
It sends its arguments, working directory, environment and standard streams to the warm process, which forks a
child that runs the script (`python FILE`, `-m MODULE`, `-c CODE`) as `__main__`. The launcher forwards the signals
it gets to that child and exits as it did (the same code, or killed by the same signal); if the launcher is killed
(SIGKILL), the child kills itself. Anything the warm process cannot reproduce exactly (interpreter options other
than -u, an environment that changes what the preloaded libraries read at import) runs in the real interpreter.

    python -m tests.warm_python SOCKET_PATH LAUNCHER   # the warm process; the suite starts it (tests/conftest.py)
"""

from __future__ import annotations

import gc
import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
from pathlib import Path

REAL_PYTHON = sys.executable  # in the pytest process, read before the suite replaces sys.executable
# Not Lightning: importing it decides things from the process's state at that moment (which rank this is, from the
# environment; whether its loggers print themselves or leave that to handlers already on the root logger), and a
# child must decide them as a fresh process would. torchmetrics and torch._dynamo, both imported by Lightning, are
# most of its import time (dynamo alone 2 s of every rank's start on our 2-core machines, measured with py-spy).
PRELOADED = ("torch", "torch.distributed", "torch._dynamo", "deepspeed", "hydra", "omegaconf", "torchmetrics")
# Read by the preloaded libraries (or the interpreter) when they start, so a run that sets them differently starts
# cold. Everything else in the environment is read at run time and is simply replaced in the child.
READ_AT_START = ("PYTHONOPTIMIZE", "PYTHONHASHSEED", "PYTHONSAFEPATH", "PYTHONHOME", "TORCH_LOGS", "OMP_WAIT_POLICY",
                 "PYTORCH_JIT", "LD_PRELOAD", "LD_LIBRARY_PATH", "DS_ACCELERATOR",
                 "LIGHTNING_DIST_FAKE_CUDA_DEVICES")  # the dry run's fake CUDA is loaded before torch
# dynamo's and inductor's configs read their variables when torch._dynamo is imported.
READ_AT_START_PREFIXES = ("TORCHDYNAMO", "TORCHINDUCTOR", "TORCH_COMPILE")
HEADER = struct.Struct("!I")
_SET_BY_IMPORTS: dict[str, str] = {}

LAUNCHER = r'''#!{real_python} -IS
import json, os, signal, socket, struct, sys
SOCKET, REAL = {socket_path!r}, {real_python!r}
args = sys.argv[1:]

def cold():
    os.execv(REAL, [REAL, *args])

unbuffered = args[:1] == ["-u"]
words = args[1:] if unbuffered else args
if not words or (words[0].startswith("-") and (words[0] not in ("-m", "-c") or len(words) < 2)):
    cold()
if words[:2] == ["-m", "submitit.local._local"]:  # names its job folder by its own pid: the pid its starter saw
    cold()
# py-cpuinfo's probe (DeepSpeed's op builders ask it once a job): standard library only, 0.75 CPU-s cold, 1.5 as a copy
# of the warm process, whose exit then tears down torch as well.
if words[0].endswith("/cpuinfo/cpuinfo.py"):
    cold()
mode, target, rest = ("script", words[0], words[1:]) if not words[0].startswith("-") else (words[0][1], words[1], words[2:])
env = dict(os.environ)
if unbuffered:
    env["PYTHONUNBUFFERED"] = "1"
request = json.dumps({{"mode": mode, "target": target, "argv": rest, "args": args, "cwd": os.getcwd(), "env": env}}).encode()
try:
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(SOCKET)
    socket.send_fds(conn, [struct.pack("!I", len(request))], [0, 1, 2])
    conn.sendall(request)
    stream = conn.makefile("rb")
    reply = json.loads(stream.readline())
except OSError as error:  # no warm process to ask: said beside its socket, for whoever wonders why a run was slow
    try:
        with open(SOCKET + ".cold.log", "a") as log:
            log.write(f"{{args}}: {{error!r}}\n")
    except OSError:
        pass
    cold()
if "cold" in reply:
    cold()
child = reply["pid"]
if os.environ.get("LIGHTNING_DIST_LAUNCHER_PID", str(os.getpid())) != str(os.getpid()):
    # A rank another process started dies with that process (lightning_dist/lifecycle/stop_signals.py). This launcher's parent
    # is that process; the child's is the warm one, and the child dies with this launcher (_die_with).
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
for forwarded in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT):
    signal.signal(forwarded, lambda number, frame: os.kill(child, number))
status = json.loads(stream.readline())["status"]
if os.WIFSIGNALED(status):
    if os.WTERMSIG(status) not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
    os.kill(os.getpid(), os.WTERMSIG(status))
os._exit(os.waitstatus_to_exitcode(status))
'''


def write_launcher(path: Path, socket_path: str, real_python: str = REAL_PYTHON) -> Path:
    path.write_text(LAUNCHER.format(real_python=real_python, socket_path=socket_path))
    path.chmod(0o755)
    return path


def wait_until_serving(server, socket_path: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(socket_path):
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the warm Python did not start (exit code {server.poll()}); see its log beside {socket_path}")
        time.sleep(0.05)


def serve(socket_path: str, launcher: str) -> None:
    """The warm process: preload, then fork a child per request until the process that started it is gone. In the
    children `sys.executable` is `launcher`, so that the ranks a run starts are forked from here too."""
    import importlib

    environment = dict(os.environ)
    for name in PRELOADED:
        importlib.import_module(name)
    from deepspeed.accelerator import get_accelerator

    # What the imports put into the environment themselves (torch._dynamo: TORCHINDUCTOR_CACHE_DIR, its default): a
    # child has them as a fresh interpreter would have after the same imports, unless its own environment says else.
    global _SET_BY_IMPORTS
    _SET_BY_IMPORTS = {name: value for name, value in os.environ.items() if environment.get(name) != value}
    # DeepSpeed picked its accelerator once, at import: a run that names that one (or none) is reproducible.
    start_environment = {**os.environ, "DS_ACCELERATOR": get_accelerator().device_name()}
    sys.executable = launcher
    # The preloaded libraries' half a million objects out of the collector's reach, for every child: a child's full
    # collections and its interpreter's shutdown walked them all (1.6 CPU-s of each child's exit, 0.35 with this,
    # measured on our 2-core machines). A cycle among them that a child drops is then freed only when the child ends,
    # and `gc.get_objects()` in a child lists only what the child made: exit_quickly's flush of open files finds the
    # files a run opened; of the warm process's own, only the standard streams are open, which it flushes by name.
    gc.freeze()
    owner = os.getppid()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(socket_path + ".tmp")
    os.rename(socket_path + ".tmp", socket_path)  # the socket appears only once it is ready
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    while os.getppid() == owner:
        for _ in selector.select(timeout=0.1):
            conn, _ = listener.accept()
            request, fds = _receive(conn)
            if differing := _not_reproducible(request["env"], start_environment):
                print(f"cold: {request['args']}: {', '.join(differing)} differ", flush=True)  # into warm.log
                conn.sendall(b'{"cold": true}\n')
                conn.close()
                for fd in fds:
                    os.close(fd)
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                for other in (listener, *children.values()):
                    other.close()
                selector.close()
                _run_child(conn, request, fds)  # does not return
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid)
            try:
                conn.sendall(json.dumps({"status": status}).encode() + b"\n")
            except OSError:
                pass  # the launcher was killed: nobody is waiting
            conn.close()


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    header, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
    (length,) = HEADER.unpack(header)
    body = b""
    while len(body) < length:
        body += conn.recv(length - len(body))
    return json.loads(body), fds


def _not_reproducible(env: dict[str, str], start_environment: dict[str, str]) -> list[str]:
    """The variables read at start that the request sets otherwise than the warm process has them."""
    # As the child's environment will be once the imports it skips have set theirs (`_SET_BY_IMPORTS`).
    env = {"DS_ACCELERATOR": start_environment["DS_ACCELERATOR"], **_SET_BY_IMPORTS, **env}
    names = {*READ_AT_START, *(name for name in (*env, *start_environment) if name.startswith(READ_AT_START_PREFIXES))}
    return sorted(name for name in names if env.get(name) != start_environment.get(name))


def _run_child(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """Become the process the launcher asked for, run it as `__main__`, and exit as that interpreter would."""
    import runpy
    import threading
    import traceback

    import torch

    # A session and process group of its own: what the process does to "its group" (a kill -9 of every rank, as the
    # fault loop's probe does) reaches itself and what it started, never the warm process or the suite.
    os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT, signal.SIGCHLD):
        signal.signal(number, signal.SIG_DFL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    # The interpreter's own stream objects stay (libraries imported in the warm process hold them, Lightning's log
    # handler among them); they now write to the launcher's streams, buffered as a fresh interpreter's would be.
    env = request["env"]
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdout.reconfigure(line_buffering=os.isatty(1), write_through=unbuffered)
    sys.stderr.reconfigure(line_buffering=True, write_through=unbuffered)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({**_SET_BY_IMPORTS, **env})
    if env.get("OMP_NUM_THREADS", "").isdigit():  # read by OpenMP when torch loaded, in the warm process
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    if env.get("PYTHONWARNINGS"):  # the interpreter's own start-up reads these; the child applies them itself
        import warnings

        for option in env["PYTHONWARNINGS"].split(","):
            warnings._setoption(option)
    # If the launcher dies (even by SIGKILL, which it cannot forward), so does this process.
    threading.Thread(target=_die_with, args=(conn,), daemon=True).start()

    mode, target, argv = request["mode"], request["target"], request["argv"]
    entries = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    first = str(Path(target).resolve().parent) if mode == "script" else ("" if mode == "c" else os.getcwd())
    sys.path[:] = [first, *entries, *[entry for entry in sys.path[1:] if entry not in entries]]
    sys.argv = [target if mode == "script" else ("-c" if mode == "c" else target), *argv]
    sys.orig_argv = [sys.executable, *request["args"]]  # the command line, as a fresh interpreter reports it
    code: object = 0
    try:
        if mode == "script":
            runpy.run_path(target, run_name="__main__")
        elif mode == "m":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as exit_:
        code = exit_.code
    except KeyboardInterrupt:
        traceback.print_exc()
        _exit_by(signal.SIGINT)
    except BaseException:  # noqa: BLE001 (printed and turned into exit code 1, as the interpreter does)
        traceback.print_exc()
        code = 1
    raise SystemExit(code)  # leaves through the interpreter's normal shutdown: atexit handlers, flushed streams


def _die_with(conn: socket.socket) -> None:
    try:
        while conn.recv(1):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _exit_by(number: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(number, signal.SIG_DFL)
    os.kill(os.getpid(), number)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
