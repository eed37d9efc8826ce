"""CUDA faked where there is no GPU, for dry runs (`dry_run=true trainer=gpu`): on torch's CPU builds, and on its
CUDA builds on a machine without a GPU. Checked on torch 2.11.0 and 2.15.0 (CUDA builds, on a CPU) and 2.13.0 (CPU
build); where the shim does not build against the installed torch, the dry run says so and uses CPU fakes.

Two pieces. A shared library (fake_cuda.cpp beside this file, built once with g++ against the installed wheel's own
headers, a few seconds, then cached) registers c10's `FakeGuardImpl` as the CUDA device guard and CUDA hooks that
report the devices: fake tensors on `cuda:5` then index, copy, initialise modules and run backward as on a GPU, and
one meeting a tensor on `cpu` or `cuda:0` fails as it would there. ATen reads its CUDA hooks once, when torch is
imported, so the library is loaded first, in a process of its own: `run_with_fake_cuda` (a CUDA build registers
its own guard as torch loads, so the fake one is registered again after). Then a stand-in for the
parts of `torch.cuda` that a set-up calls (device count, `set_device`, streams, events, memory statistics), which a
CPU build implements only by raising.

This module imports torch only in that process, after the library: the caller's process never has CUDA faked.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.metadata
import importlib.util
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

SOURCE = Path(__file__).with_name("fake_cuda.cpp")
MAX_DEVICES = 8  # per node: c10's FakeGuardImpl keeps the current device in an array of 8
DEVICE_MEMORY = 80 * 2**30  # what `get_device_properties` reports; a dry run's verdict uses device_memory_gb


class FakeCudaUnavailable(RuntimeError):
    """CUDA cannot be faked here; the sentence says why."""


class FakeCudaRunFailed(RuntimeError):
    """The function run with CUDA faked raised; the message is its exception's, the traceback the child's."""

    def __init__(self, message: str, child_traceback: str) -> None:
        super().__init__(message)
        self.child_traceback = child_traceback


def run_with_fake_cuda(function: Callable[..., Any], *args: Any, devices: int) -> Any:
    """`function(*args)` in a new Python process in which torch sees `devices` CUDA devices that hold nothing.
    `function` and `args` travel by pickle (a module-level function; configurations as plain containers)."""
    library = shim_library(devices)
    with tempfile.TemporaryDirectory(prefix="fake_cuda_") as scratch:
        call, result = Path(scratch, "call.pkl"), Path(scratch, "result.pkl")
        call.write_bytes(pickle.dumps((function, args)))
        # The child imports what this process can (the user's model beside their train.py, say).
        search_path = os.pathsep.join(entry or os.getcwd() for entry in sys.path)
        environment = {**os.environ, "LIGHTNING_DIST_FAKE_CUDA_DEVICES": str(devices), "PYTHONPATH": search_path}
        process = subprocess.run([sys.executable, "-m", __name__, str(library), str(call), str(result)],
                                 env=environment, check=False)
        if not result.exists():
            raise FakeCudaUnavailable(f"the process with CUDA faked ended with exit code {process.returncode}"
                                      " before its result")
        status, value, child_traceback = pickle.loads(result.read_bytes())
    if status == "error":
        raise FakeCudaRunFailed(value, child_traceback)
    return value


def shim_library(devices: int) -> Path:
    """The built library for the installed torch (built now if not cached); FakeCudaUnavailable if it cannot be."""
    if not 1 <= devices <= MAX_DEVICES:
        raise FakeCudaUnavailable(f"{devices} devices per node; CUDA is faked for 1 to {MAX_DEVICES}")
    version = _torch_version()
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        raise FakeCudaUnavailable("this torch has CUDA: fake tensors go on its devices directly")
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise FakeCudaUnavailable("no C++ compiler (g++ or $CXX) to build the device shim")
    spec = importlib.util.find_spec("torch")  # found, not imported: the shim must load before it
    assert spec is not None and spec.submodule_search_locations is not None
    torch_dir = Path(spec.submodule_search_locations[0])
    # Keyed by the torch it links to, where it lies: the library finds libc10 by that path (its rpath), so a venv
    # made again elsewhere with the same torch release, or torch reinstalled, builds its own.
    libc10_path = torch_dir / "lib" / "libc10.so"
    if not libc10_path.exists():
        raise FakeCudaUnavailable(f"torch's libc10.so is not at {libc10_path} to build the device shim against")
    libc10 = libc10_path.stat()
    linked_to = f"{version} {torch_dir} {libc10.st_size} {libc10.st_mtime_ns}"
    digest = hashlib.sha256(SOURCE.read_bytes() + linked_to.encode()).hexdigest()[:16]
    library = _cache_dir() / f"libfake_cuda-{digest}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    partial = library.with_suffix(f".{os.getpid()}.partial")  # concurrent builders each write their own, then swap
    command = [compiler, "-shared", "-fPIC", "-O1", "-std=c++20", "-w", "-D_GLIBCXX_USE_CXX11_ABI=1",
               f"-I{torch_dir / 'include'}", str(SOURCE), f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu",
               f"-Wl,-rpath,{torch_dir / 'lib'}", "-o", str(partial)]
    built = subprocess.run(command, capture_output=True, text=True, check=False)
    if built.returncode != 0:
        partial.unlink(missing_ok=True)
        first_error = next((line for line in built.stderr.splitlines() if "error" in line), built.stderr[-300:])
        raise FakeCudaUnavailable(f"the device shim did not build: {first_error.strip()}")
    os.replace(partial, library)
    return library


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError as missing:
        raise FakeCudaUnavailable("torch is not installed") from missing


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "lightning_dist" / "fake_cuda"


def _stand_in_for_torch_cuda(devices: int) -> dict[str, Any]:
    """Replace what `torch.cuda` implements by raising on a CPU build with answers a device with nothing on it
    gives, and return what `torch.cuda` answered before. `set_device` keeps the device that `"cuda"` without an index
    means (fake tensors ask `current_device`); streams and events order nothing, because fake tensors have no work to
    order."""
    import torch

    _now = [0]  # the current device, as `set_device` left it

    def index_of(device: Any) -> int:
        if device is None:
            return _now[0]
        index = device if isinstance(device, int) else torch.device(device).index
        return _now[0] if index is None or index < 0 else index

    def set_device(device: Any) -> None:
        index = index_of(device)
        if index >= devices:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index} (this node has {devices})")
        _now[0] = index
        torch.accelerator.set_device_index(index)  # the device guard's too: ATen resolves "cuda" with it

    class Event:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def record(self, stream: Any = None) -> None:
            pass

        def wait(self, stream: Any = None) -> None:
            pass

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end: Any) -> float:
            return 0.0

    class Stream:
        def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
            self.device = torch.device("cuda", index_of(device))
            self.priority = priority
            # What torch.Stream says of itself (FSDP2 hands them to an op as it frees a reduced gradient, 2.15)
            self.stream_id, self.device_index, self.device_type = 0, self.device.index, 1  # 1: c10's CUDA

        def wait_stream(self, stream: Any) -> None:
            pass

        def wait_event(self, event: Any) -> None:
            pass

        def record_event(self, event: Any = None) -> Event:
            return event or Event()

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

    default_streams: dict[int, Stream] = {}

    def current_stream(device: Any = None) -> Stream:
        index = index_of(device)
        return default_streams.setdefault(index, Stream(index))

    @contextmanager
    def stream(stream: Any) -> Any:
        yield stream

    @contextmanager
    def device(device: Any) -> Any:
        before = _now[0]
        set_device(device)
        try:
            yield
        finally:
            _now[0] = before

    def properties(device: Any = None) -> SimpleNamespace:
        return SimpleNamespace(name="fake CUDA device", major=9, minor=0, total_memory=DEVICE_MEMORY,
                               multi_processor_count=132, is_integrated=False)

    zero = lambda *args, **kwargs: 0  # noqa: E731 - nothing is allocated
    nothing = lambda *args, **kwargs: None  # noqa: E731
    answers = {
        "is_available": lambda: True, "is_initialized": lambda: True, "_lazy_init": nothing, "init": nothing,
        "device_count": lambda: devices, "current_device": lambda: _now[0], "set_device": set_device,
        "device": device, "get_device_name": lambda device=None: "fake CUDA device",
        "get_device_capability": lambda device=None: (9, 0), "get_device_properties": properties,
        "is_bf16_supported": lambda *args, **kwargs: True, "synchronize": nothing, "empty_cache": nothing,
        "Stream": Stream, "Event": Event, "current_stream": current_stream, "default_stream": current_stream,
        "stream": stream, "set_stream": nothing, "memory_allocated": zero, "max_memory_allocated": zero,
        "memory_reserved": zero, "max_memory_reserved": zero, "reset_peak_memory_stats": nothing,
        "memory_stats": lambda *args, **kwargs: {}, "mem_get_info": lambda device=None: (DEVICE_MEMORY,) * 2,
        "is_current_stream_capturing": lambda: False,  # optimizers ask before each step; no CUDA graph is captured
    }
    before = {name: getattr(torch.cuda, name) for name in answers}
    for name, answer in answers.items():
        setattr(torch.cuda, name, answer)
    # Profiler ranges (DeepSpeed marks every ZeRO function with one): a build without CUDA has no NVTX library.
    for name in ("range_push", "range_pop", "mark", "range_start", "range_end"):
        setattr(torch.cuda.nvtx, name, zero)
    # Telling the caching allocator which stream still uses a tensor (DeepSpeed does, as ZeRO-3 frees a gathered
    # parameter): nothing is allocated, and the streams above are not torch's.
    torch.Tensor.record_stream = lambda tensor, stream: None
    # Fake tensors make one real tensor on each CUDA device they meet, where torch says it has CUDA (on a CUDA
    # build, through these answers): there is no device to make it on, and nothing here needs its context.
    from torch._subclasses import fake_tensor

    fake_tensor.init_gpu_context = lambda device: None
    return before


@contextmanager
def _registry_notices_dropped() -> Any:
    """Within: what is written to stderr, but the line c10's registry prints for each of a CUDA build's own
    registrations that the shim's take precedence over ("Higher priority item already registered, ...")."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().decode(errors="replace").splitlines(keepends=True)
                    if not line.startswith("Higher priority item already registered")]
            sys.stderr.write("".join(kept))


# Libraries that choose their backend from torch.cuda as they are imported: they see the machine as it is.
# bitsandbytes (which PEFT imports) took the fake devices for CUDA and bound the CUDA build's stream API, and a LoRA
# run's dry run stopped (AttributeError: _cuda_getCurrentRawStream).
IMPORTED_WITHOUT_THE_DEVICES = ("bitsandbytes",)


class _ImportedWithoutTheDevices(importlib.abc.MetaPathFinder):
    """Imports the packages of IMPORTED_WITHOUT_THE_DEVICES, where a call imports them, with `torch.cuda` answering
    as it did before the stand-in (`machine`). Not imported up front: bitsandbytes brings torch's inductor, about 3 s
    of every dry run, most of which never import it."""

    def __init__(self, machine: dict[str, Any]) -> None:
        self.machine = machine

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in IMPORTED_WITHOUT_THE_DEVICES:
            return None
        sys.meta_path.remove(self)  # the spec the other finders give
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            spec.loader = _LoadedWith(spec.loader, self.machine)
        return spec


class _LoadedWith(importlib.abc.Loader):
    """`loader`, its module run with `torch.cuda`'s `answers` in place (its own imports within included)."""

    def __init__(self, loader: Any, answers: dict[str, Any]) -> None:
        self.loader, self.answers = loader, answers

    def __getattr__(self, name: str) -> Any:  # the rest of a loader's interface (resource readers, ...): its own
        return getattr(self.loader, name)

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        import torch

        faked = {name: getattr(torch.cuda, name) for name in self.answers}
        for name, answer in self.answers.items():
            setattr(torch.cuda, name, answer)
        try:
            self.loader.exec_module(module)
        finally:
            for name, answer in faked.items():
                setattr(torch.cuda, name, answer)


def _child(library: str, call: str, result: str) -> None:
    import ctypes
    import traceback

    if "torch" in sys.modules:
        raise RuntimeError("torch was imported before the device shim; ATen would not see the fake CUDA hooks")
    shim = ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
    with _registry_notices_dropped():
        import torch  # noqa: F401 - a CUDA build registers its device guard as it loads: the fake one goes back over it
    shim.fake_cuda_register_guard()
    machine = _stand_in_for_torch_cuda(int(os.environ["LIGHTNING_DIST_FAKE_CUDA_DEVICES"]))
    sys.meta_path.insert(0, _ImportedWithoutTheDevices(machine))
    function, args = pickle.loads(Path(call).read_bytes())
    try:
        outcome = ("ok", function(*args), "")
    except Exception as error:  # noqa: BLE001 - reported to the parent, which raises it
        outcome = ("error", f"{type(error).__name__}: {error}", traceback.format_exc())
    Path(result).write_bytes(pickle.dumps(outcome))


if __name__ == "__main__":
    _child(*sys.argv[1:4])
