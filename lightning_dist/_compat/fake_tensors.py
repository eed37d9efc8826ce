"""torch's fake tensors, fake process group and memory trackers, as the dry run (lightning_dist/dry_run/ranks.py) and
Lightning's whole loop on fake devices (lightning_dist/dry_run/fake_loop.py) use them. Fake tensors have shapes and
devices but no storage; where they behave otherwise than tensors on a device, what a device would do is done here, each
in the open and behind the fence. Checked on torch 2.11.0, 2.13.0 and 2.15.0."""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_dist._compat.fenced import Fenced
from lightning_dist._compat.torch import apply_to_tensors

__all__ = [
    "data_loaded_outside_fake_tensors", "ddp_on_fake_tensors", "device_mismatch", "fake_devices",
    "fake_parameters_converted_in_place", "fake_pinned_memory", "fake_process_group", "fake_scalars",
    "fake_tensors", "fake_tensors_as_tensors", "fsdp_memory_tracker", "largest_data_dependent_shapes",
    "made_fake_in_place", "memory_categories", "meshes_built_outside_fake_tensors", "module_memory_tracker",
    "object_collectives_kept_local", "outside_fake_tensors", "storage_categorized_tracker",
    "tensors_from_data_made_on_the_host",
]

FENCED = [
    Fenced("torch.testing._internal.distributed.fake_pg", "FakeStore"),
    Fenced("torch._subclasses.fake_tensor", "FakeTensorMode", ("allow_fallback_kernels", "allow_non_fake_inputs")),
    Fenced("torch._subclasses.fake_tensor", "FakeTensorMode.avoid_device_init"),  # overridden: fake_tensors()
    Fenced("torch._subclasses.fake_tensor", "unset_fake_temporarily"),
    Fenced("torch.utils._python_dispatch", "_disable_current_modes", ()),
    Fenced("torch._subclasses.fake_tensor", "init_gpu_context", ("device",)),  # fake_cuda.py: not on a fake device
    Fenced("torch.nn.parallel.distributed", "_verify_param_shape_across_processes", ("process_group", "tensors")),
    Fenced("torch.distributed", "Logger.set_runtime_stats_and_log"),
    Fenced("torch.distributed", "Reducer._rebuild_buckets"),
    Fenced("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker", ("mod", "optm")),
    Fenced("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker.get_tracker_snapshot", ("self", "type")),
    Fenced("torch.distributed._tools.mem_tracker", "MemTracker.track_external", ("self",)),
    # The trackers' per-op peak update and their hooks on each parameter (_dry_run_tracker; the hooks are kept in
    # the instance's `_param_to_grad_hook_handles`), the state they read, and how a storage gets its category.
    Fenced("torch.distributed._tools.mem_tracker", "MemTracker._update_peak_stats", ("self", "peak_state")),
    Fenced("torch.distributed._tools.mem_tracker", "MemTracker._track_module_params_and_buffers",
           ("self", "module", "install_grad_hooks")),
    Fenced("torch.distributed._tools.mem_tracker", "MemTracker._update_and_maybe_create_winfos",
           ("self", "t", "reftype", "update_existing")),
    Fenced("torch.distributed._tools.mem_tracker", "_RefType"),
    Fenced("torch.distributed._tools.mem_tracker", "_TOTAL_KEY"),
    Fenced("torch.distributed._tools.common_utils", "get_untyped_storages", ("t",)),
    Fenced("torch.utils", "swap_tensors", ("t1", "t2")),
]


@contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """The default process group as rank `rank` of `world_size`: collectives complete at once, sending nothing.
    torch's "fake" backend, registered by its test utilities' FakeStore module (no public home yet)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextmanager
def meshes_built_outside_fake_tensors() -> Iterator[None]:
    """Device meshes made within (FSDP2 makes a DP x TP mesh as it shards a tensor-parallel model; a strategy slices
    its mesh) compute their coordinates with real ops on their few integers, outside every dispatch mode: fake
    tensors cannot (`nonzero` has no fake output shape), nor may the modes above them answer for them. A rank
    tensor sliced from a real mesh in fake mode is a fake one that keeps its values: those are used."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import _disable_current_modes

    original = DeviceMesh.__init__

    def real(value: Any) -> Any:
        return value.constant if isinstance(value, FakeTensor) and value.constant is not None else value

    def construct(mesh: DeviceMesh, *args: Any, **kwargs: Any) -> None:
        with _disable_current_modes():
            original(mesh, *[real(a) for a in args], **{k: real(v) for k, v in kwargs.items()})

    DeviceMesh.__init__ = construct
    try:
        yield
    finally:
        DeviceMesh.__init__ = original


@contextmanager
def object_collectives_kept_local() -> Iterator[None]:
    """Within: the collectives of picklable objects answer with this rank's own object (as if every rank had sent
    it), where over torch's fake process group nothing arrives to unpickle. Lightning broadcasts its log directory
    and checkpoint paths so; our callbacks gather their figures."""
    from unittest import mock

    import torch.distributed as dist

    def broadcast_object_list(object_list: list, *args: Any, **kwargs: Any) -> None:
        return None  # the list holds this rank's objects, as rank 0's would arrive

    def all_gather_object(object_list: list, obj: Any, *args: Any, **kwargs: Any) -> None:
        object_list[:] = [obj] * len(object_list)

    def gather_object(obj: Any, object_gather_list: list | None = None, *args: Any, **kwargs: Any) -> None:
        if object_gather_list is not None:
            object_gather_list[:] = [obj] * len(object_gather_list)

    with (mock.patch.object(dist, "broadcast_object_list", broadcast_object_list),
          mock.patch.object(dist, "all_gather_object", all_gather_object),
          mock.patch.object(dist, "gather_object", gather_object)):
        yield


@contextmanager
def data_loaded_outside_fake_tensors() -> Iterator[None]:
    """Within: a data loader's iterator is made, and each batch loaded, outside fake tensors: its sampler reads
    values (`randperm(...).tolist()`), and its batches are real host tensors, which a step then moves to its device."""
    from unittest import mock

    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils.data import DataLoader

    make_iterator = DataLoader.__iter__

    class RealBatches:
        def __init__(self, loader: DataLoader) -> None:
            with unset_fake_temporarily():
                self.batches = make_iterator(loader)

        def __iter__(self) -> RealBatches:
            return self

        def __next__(self) -> Any:
            with unset_fake_temporarily():
                return next(self.batches)

        def __len__(self) -> int:
            return len(self.batches)

    with mock.patch.object(DataLoader, "__iter__", lambda loader: RealBatches(loader)):
        yield


@contextmanager
def outside_fake_tensors() -> Iterator[None]:
    """Within: tensors are real again, every dispatch mode set aside (fake tensors' and those above them)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


@contextmanager
def fake_devices() -> Iterator[Any]:
    """Within: every tensor made or moved is a fake tensor (yields the mode), with what fake tensors do otherwise
    than devices done as devices do: pinning, reading values, value-dependent shapes, deep copies, `.data =`,
    tensors from data on a device, converting parameters in place, and device meshes."""
    with contextlib.ExitStack() as stack:
        mode = stack.enter_context(fake_tensors())
        for context in (meshes_built_outside_fake_tensors(), fake_pinned_memory(), fake_scalars(),
                        largest_data_dependent_shapes(), fake_tensors_as_tensors(),
                        tensors_from_data_made_on_the_host(), fake_parameters_converted_in_place()):
            stack.enter_context(context)
        yield mode


@contextmanager
def ddp_on_fake_tensors() -> Iterator[None]:
    """Within: DDP is built and stepped over fake tensors and the fake process group. Three of its steps read
    tensors or need CUDA's runtime, and are skipped: comparing parameter shapes across ranks (there is one rank
    here), timing each step with a CUDA timer (a build without CUDA has none), and reordering its buckets after the
    first step from an index tensor (the same bytes, in the order gradients came). Each DDP made here all-reduces
    its buckets through a hook of its own (`_all_reduce_bucket`)."""
    from unittest import mock

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    construct = DistributedDataParallel.__init__

    def construct_with_hook(wrapper: DistributedDataParallel, *args: Any, **kwargs: Any) -> None:
        construct(wrapper, *args, **kwargs)
        wrapper.register_comm_hook(None, _all_reduce_bucket)

    with (mock.patch("torch.nn.parallel.distributed._verify_param_shape_across_processes"),
          mock.patch.object(dist.Logger, "set_runtime_stats_and_log", lambda logger: None),
          mock.patch.object(dist.Reducer, "_rebuild_buckets", lambda reducer: False),
          mock.patch.object(DistributedDataParallel, "__init__", construct_with_hook)):
        yield


def _all_reduce_bucket(state, bucket):  # noqa: ANN001, ANN202 - DDP refuses hooks annotated otherwise than it says
    """DDP's all-reduce of one gradient bucket, done: the collective is made (and device-checked), nothing waits.
    DDP's own all-reduce expects the fake group's work to carry the tensors back; it does not."""
    import torch.distributed as dist

    dist.all_reduce(bucket.buffer())
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


class fake_pinned_memory(TorchDispatchMode):
    """Within (above fake tensors): pinning a fake host tensor gives a fake copy. Fake tensors do not implement
    `pin_memory` (FSDP2 pins offloaded shards, DeepSpeed its host buffers); a pinned page counts as host memory."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten._pin_memory.default:
            return torch.empty_like(args[0])
        return func(*args, **(kwargs or {}))


def fake_tensors() -> Any:
    """A mode in which tensors have shapes and devices but no storage; real and meta tensors met there are
    converted (FSDP2 keeps meta tensors of its own). No real device is ever touched: a value made from data is made
    on the host, and a copy to a device is never run for real (what torch's mode does where it has no CUDA; here
    CUDA may be faked, or be a real device a dry run must not allocate on)."""
    return _FakeTensorsWithoutDevices(allow_non_fake_inputs=True)


@functools.cache
def _fake_tensor_mode_class() -> type:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode


def _FakeTensorsWithoutDevices(**options: Any) -> Any:  # noqa: N802 - a class, made on first use (torch imports late)
    return _without_devices(_fake_tensor_mode_class())(**options)


@functools.cache
def _without_devices(mode_class: type) -> type:
    return type("FakeTensorsWithoutDevices", (mode_class,), {"avoid_device_init": property(lambda self: True)})


# How fake tensors refuse an op given tensors on two devices, where no error class says it (the class came in torch
# 2.13: 2.11 and 2.12 raise a RuntimeError saying this), and an in-place op on a tensor on another device than the
# op's (every version): each with the op's device first.
_DEVICE_MISMATCH_MESSAGES = (
    (re.compile(r"Unhandled FakeTensor Device Propagation for \S+, found two different devices (\S+), (\S+)$"), 1, 2),
    (re.compile(r"FakeTensor is wrapped to wrong device, found (\S+), expected (\S+)$"), 2, 1),
)


def device_mismatch(error: Exception) -> tuple[torch.device, torch.device] | None:
    """The two devices of a fake-tensor op given tensors on both (the op's first), or None for any other error."""
    from torch._subclasses import fake_tensor

    mismatch = getattr(fake_tensor, "FakeTensorDeviceMismatchError", None)
    if mismatch is not None and isinstance(error, mismatch):
        return error.common_device, error.device
    if isinstance(error, RuntimeError):
        for pattern, first, second in _DEVICE_MISMATCH_MESSAGES:
            if found := pattern.search(str(error).strip()):
                return torch.device(found.group(first)), torch.device(found.group(second))
    return None


def fsdp_memory_tracker(model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """torch's memory tracker for FSDP2 models: bytes by category (sharded and gathered parameters, gradients,
    optimizer state, communication buffers, activations, temporaries), at the peak of what it followed."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    return _dry_run_tracker(FSDPMemTracker)(model, optimizer)


def module_memory_tracker(model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """torch's memory tracker for a model that is not FSDP's (DDP): parameters, buffers, gradients, optimizer
    state, activations and temporaries, at the peak of what it followed."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = _dry_run_tracker(MemTracker)()
    tracker.track_external(model, optimizer)
    return tracker


def pipeline_memory_tracker(model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """torch's module memory tracker for pipeline stages, which run once per microbatch: each call of a module is
    followed as its first (torch's tracker refuses a module called again in one step: "does not support memory
    tracking for multiple iterative calls"); the rank's peak is what it reports."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class Tracker(_dry_run_tracker(MemTracker)):
        def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

    tracker = Tracker()
    tracker.track_external(model, optimizer)
    return tracker


@functools.cache
def _dry_run_tracker(tracker_class: type) -> type:
    """`tracker_class` keeping the rank's peak only, and following frozen parameters.

    torch's trackers also keep each module's own peak, walking every module they follow on every op: 150 of the
    190 s a 7B model's ZeRO-3 step took, for figures no dry run reads. And they hook every parameter's gradient,
    which a parameter that does not train refuses ("cannot register a hook on a tensor that doesn't require
    gradient": a LoRA model's base): a frozen parameter is given hooks that do nothing, so the tracker skips it (its
    memory is still counted; it has no gradient to follow)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    def _update_peak_stats(self: Any, peak_state: Any) -> None:
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                self._peak_mem[device] = snapshot[_TOTAL_KEY]
                self._peak_mem_snap[device] = dict(snapshot)

    def _track_module_params_and_buffers(self: Any, module: nn.Module, install_grad_hooks: bool = True) -> Any:
        for param in module.parameters():
            if not param.requires_grad and param not in self._param_to_grad_hook_handles:
                self._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)
        return tracker_class._track_module_params_and_buffers(self, module, install_grad_hooks)

    overrides = {"_update_peak_stats": _update_peak_stats,
                 "_track_module_params_and_buffers": _track_module_params_and_buffers}
    return type(tracker_class.__name__, (tracker_class,), overrides)


class _NoHook:
    """A hook handle for a hook never registered."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


def storage_categorized_tracker(categories: dict[str, str], module: nn.Module) -> Any:
    """torch's module memory tracker with categories of its own (name: label; "PARAM", "GRAD", "OPT", ... are the
    tracker's, and may be renamed, e.g. "UNSHARDED_PARAM": "Parameter"), following `module`. Its `categorize(name,
    tensors)` puts their storages in category `name` for good: the tracker's own later guesses (every parameter a
    forward meets is "Parameter") do not move them; `categorize(name, tensors, fixed_for_good=False)` only moves those
    no fixed category holds."""
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.mem_tracker import MemTracker, _RefType

    kinds = _RefType("Categories", list(categories.items()))
    fixed: set[Any] = set()  # the categories `categorize` gave

    class Tracker(_dry_run_tracker(MemTracker)):
        def _update_and_maybe_create_winfos(self, t: torch.Tensor, reftype: Any, update_existing: bool = False) -> Any:
            known = [self._WINFO[storage][0] for storage in get_untyped_storages(t) if storage in self._WINFO]
            if any(winfo.reftype in fixed for winfo in known):
                return set(known)
            return super()._update_and_maybe_create_winfos(t, reftype, update_existing)

        def categorize(self, name: str, tensors: Iterable[torch.Tensor], fixed_for_good: bool = True) -> None:
            fixed.discard(kinds[name])
            for tensor in tensors:
                self._update_and_maybe_create_winfos(tensor, kinds[name])
            if fixed_for_good:
                fixed.add(kinds[name])

    tracker = Tracker()
    tracker._ref_class = kinds
    tracker.track_external(module)
    return tracker


class fake_scalars(TorchDispatchMode):
    """Within (above fake tensors): reading a fake tensor's value (`.item()`, `if tensor:`) gives 1.0 for a
    floating-point tensor, 0 for an integer one and False for a flag, where fake tensors refuse (they have no
    values). DeepSpeed's step reads its gradient norm (finite: the step is taken), overflow flags (none) and torch
    Adam's step count (one: Adam divides by its bias correction); the memory a step takes depends on none of them."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            tensor = args[0]
            return False if tensor.dtype == torch.bool else 1.0 if tensor.is_floating_point() else 0
        if func is torch.ops.aten.is_nonzero.default:  # `if tensor:`, which fake tensors answer by reading it
            return False
        return func(*args, **(kwargs or {}))


class largest_data_dependent_shapes(TorchDispatchMode):
    """Within (above fake tensors): an op whose output's shape depends on values (`nonzero`, through which a boolean
    mask indexes) gives its largest output, every element selected, where fake tensors refuse (they have no values
    to count). torchmetrics' perplexity masks the ignored targets so; for memory and devices, an upper bound."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten.nonzero.default:
            return self._every_position(args[0]).t()
        if func is torch.ops.aten.index.Tensor and any(_is_mask(index) for index in args[1]):
            indices = [list(self._every_position(index)) if _is_mask(index) else [index] for index in args[1]]
            return func(args[0], [index for group in indices for index in group])
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _every_position(mask: torch.Tensor) -> torch.Tensor:
        """What `nonzero(mask)` gives where every element is selected, one row per dimension."""
        return torch.empty((mask.dim(), mask.numel()), dtype=torch.long, device=mask.device)


def _is_mask(index: torch.Tensor | None) -> bool:
    return index is not None and index.dtype == torch.bool


class fake_tensors_as_tensors(TorchFunctionMode):
    """Within (above fake tensors): two things a fake tensor does otherwise than a tensor, done as a tensor does.
    `tensor.data = other` moves `tensor` to `other`'s device (a fake tensor keeps reporting its old one: DeepSpeed
    moves each parameter it partitions so). `copy.deepcopy` of a fake tensor is its clone, where torch's deep copy
    of its storage fails (on the meta device): torchmetrics deep-copies every state's default, Lightning's logged
    values among them."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.Tensor.__deepcopy__ and _is_fake(args[0]):
            original, memo = args[0], args[1]
            copied = original.detach().clone().requires_grad_(original.requires_grad)
            memo[id(original)] = copied
            return copied
        result = func(*args, **(kwargs or {}))
        # `==`: each read of a descriptor's `__set__` makes a new method wrapper
        if func == torch.Tensor.data.__set__ and _is_fake(args[0]) and _is_fake(args[1]):
            args[0].fake_device = args[1].fake_device
        return result


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def made_fake_in_place(module: nn.Module, mode: Any) -> None:
    """Every real tensor of `module` (parameters, buffers, torchmetrics' states) becomes a fake one of `mode`, each
    parameter the same object (optimizers and engines that hold it see the change); meta tensors stay as they are.
    Within `fake_parameters_converted_in_place`."""
    apply_to_tensors(module, lambda t: t if t.is_meta or _is_fake(t) else mode.from_tensor(t))


class tensors_from_data_made_on_the_host(TorchFunctionMode):
    """Within (above fake tensors): `torch.tensor(data, device=...)` (and `torch.as_tensor` of data that is not a
    tensor) for a device other than the host is made on the host, then copied into a fake tensor on the device.
    Fake mode makes such a tensor for real and keeps it as a constant, and ops on constants run for real: where CUDA
    is faked there is no real CUDA tensor to make (DeepSpeed makes its gradient norm's error flag so, torchmetrics a
    weight)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        from_data = func is torch.tensor or (func is torch.as_tensor and not isinstance(args[0], torch.Tensor))
        if from_data and device is not None and torch.device(device).type != "cpu":
            requires_grad = kwargs.pop("requires_grad", False)
            on_host = func(*args, **{**kwargs, "device": "cpu"})
            made = torch.empty(on_host.shape, dtype=on_host.dtype, device=device).copy_(on_host)
            return made.requires_grad_(requires_grad) if requires_grad else made
        return func(*args, **kwargs)


@contextmanager
def fake_parameters_converted_in_place() -> Iterator[None]:
    """Within: `Module.to(...)` and its kin convert fake parameters by giving them the converted data, where torch
    swaps each parameter with its converted copy, which fake tensors refuse (their mode holds weak references to
    them). DeepSpeed's engine moves and casts the module it is given. A parameter built on the meta device and given
    fake memory (`sharded_init.give_memory`) is swapped with it all the same: the weak references the mode keeps to
    the real tensors it converted are looked up for real tensors only, and this one becomes fake."""
    from types import SimpleNamespace
    from unittest import mock

    from torch._subclasses.fake_tensor import FakeTensor

    swap = torch.utils.swap_tensors

    def swap_or_assign(t1: torch.Tensor, t2: torch.Tensor) -> None:
        if isinstance(t1, FakeTensor) and isinstance(t2, FakeTensor):
            t1.data = t2.data
            t1.fake_device = t2.fake_device  # the device a fake tensor reports: `.data =` leaves it (`.to("cuda")`)
        elif isinstance(t1, FakeTensor) or isinstance(t2, FakeTensor):
            with mock.patch.object(torch.utils, "weakref", SimpleNamespace(getweakrefs=lambda tensor: [])):
                swap(t1, t2)
        else:
            swap(t1, t2)

    with mock.patch.object(torch.utils, "swap_tensors", swap_or_assign):
        yield


def memory_categories(tracker: Any) -> dict[str, dict[str, int]]:
    """For each device `tracker` followed ("cuda:5", "cpu"): bytes by category (SHARDED_PARAM, ACT, ..., "Total")
    at that device's peak."""
    return {str(device): {str(getattr(key, "name", key)): int(value) for key, value in categories.items()}
            for device, categories in tracker.get_tracker_snapshot("peak").items()}


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a fake tensor (a dry run's): a shape and a device, no values to read."""
    from torch._subclasses.fake_tensor import is_fake as torch_is_fake

    return bool(torch_is_fake(tensor))
