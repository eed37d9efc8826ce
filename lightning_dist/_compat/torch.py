"""torch internals. Checked on torch 2.11.0, 2.13.0 and 2.15.0 (CI's compatibility tier runs the oldest and the
newest); where releases differ, each function here chooses by what the installed torch has, not by its version."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_WRAPPED_MODULE,
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_dist._compat.fenced import Fenced

__all__ = [
    "apply_to_tensors",
    "attention_function_replaced",
    "checkpoint_loads_in_one_process",
    "checkpoint_wrapper",
    "CheckpointWrapper",
    "compilation_events",
    "compiled_wrappers",
    "COMPILED_PREFIX",
    "compile_forward",
    "eager",
    "cpu_flash_attention",
    "cuda_flash_attention",
    "ring_attention",
    "cpu_supports_fp16",
    "default_process_group_store",
    "extension_build_lock",
    "host_sync_kind",
    "flatten_mesh_dims",
    "forward_hook_tables",
    "fsdp_param_groups",
    "inductor_cache_dir",
    "is_compiled",
    "local_shard_region",
    "local_tensor",
    "own_parameters",
    "pipeline_schedule",
    "runs_v_schedules",
    "forward_only_order",
    "running_order",
    "parameter_registration",
    "read_entries",
    "reopen_fsdp_forward",
    "saved_file_extents",
    "set_default_process_group_timeout",
    "storage_identity",
    "storage_owner",
    "TorchDispatchMode",
    "tree_map",
    "wrapped_module",
    "ATTENTION_KERNEL_OPS",
    "COLLECTIVE_NAMESPACES",
    "DCP_METADATA_GLOBALS",
    "WRAPPER_MODULE_NAMES",
    "checkpointed_module",
    "parameter_initialiser",
]

# The names torch's wrappers insert between a model and its layers: activation checkpointing's, and FSDP1's.
WRAPPER_MODULE_NAMES = (_CHECKPOINT_WRAPPED_MODULE, "_fsdp_wrapped_module")
# The kernels scaled_dot_product_attention dispatches to, by their (private) aten op names.
ATTENTION_KERNEL_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
# The op namespaces of collectives: process groups' ops, and the functional ones DTensor uses.
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
# Globals that torch.distributed.checkpoint's `.metadata` pickle names besides its own record classes.
DCP_METADATA_GLOBALS = {("torch.serialization", "_get_layout")}

FENCED = [
    Fenced("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "_CHECKPOINT_WRAPPED_MODULE"),
    Fenced("torch.serialization", "_get_layout"),
    Fenced("torch._dynamo.eval_frame", "OptimizedModule"),  # torch.compile(module)'s wrapper (compiled_wrappers)
    Fenced("torch", "ops._c10d_functional.all_gather_into_tensor"),
    Fenced("torch.nn", "MultiheadAttention._reset_parameters", ("self",)),
    *(Fenced("torch", f"ops.aten.{name}") for name in ATTENTION_KERNEL_OPS),
    Fenced("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "CheckpointWrapper"),
    Fenced("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "checkpoint_wrapper", ("module",)),
    Fenced("torch.distributed.device_mesh", "DeviceMesh._flatten", ("self", "mesh_dim_name")),
    Fenced("torch.distributed.tensor", "DTensor._local_tensor"),  # a slot: read, never written
    Fenced(
        "torch.distributed.tensor._utils",
        "compute_local_shape_and_global_offset",
        ("global_shape", "mesh", "placements"),
    ),
    Fenced("torch.distributed.fsdp._fully_shard._fsdp_common", "TrainingState.FORWARD"),
    Fenced(
        "torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup"
    ),  # `_training_state`, as the state
    Fenced("torch.distributed.fsdp._fully_shard._fully_shard", "FSDPModule._get_fsdp_state", ("self",)),
    Fenced("torch.nn", "Module._apply", ("self", "fn")),
    Fenced("torch.distributed.distributed_c10d", "default_pg_timeout"),
    Fenced("torch.distributed.distributed_c10d", "default_pg_nccl_timeout"),
    Fenced("torch.distributed.distributed_c10d", "_get_default_store", ()),
    Fenced("torch.utils._pytree", "tree_map", ("func", "tree")),
    # What a DCP checkpoint's `.metadata` records of where each entry's bytes lie (`Metadata.storage_data` values).
    Fenced("torch.distributed.checkpoint.filesystem", "_StorageInfo", ("relative_path", "offset", "length")),
    # Swapped while one rank loads (checkpoint_loads_in_one_process): Lightning's sharded load calls it by this name.
    Fenced("torch.distributed.checkpoint", "load",
           ("state_dict", "checkpoint_id", "storage_reader", "planner", "process_group", "no_dist")),
    # Sharded saves write each replicated item (a buffer each rank keeps for itself) as rank 0 holds it (background.py).
    Fenced("torch.distributed.checkpoint", "DefaultSavePlanner.__init__",
           ("self", "flatten_state_dict", "flatten_sharded_tensors", "dedup_replicated_tensors",
            "dedup_save_to_lowest_rank")),
    Fenced("torch._dynamo.callback", "callback_handler"),
    Fenced("torch._dynamo.callback", "CompilationCallbackHandler.register_start_callback", ("self", "callback")),
    Fenced("torch._dynamo.callback", "CompilationCallbackHandler.register_end_callback", ("self", "callback")),
    Fenced("torch._inductor.runtime.cache_dir_utils", "cache_dir", ()),
    # The lock a JIT extension build holds (`_jit_compile` names it `lock` in the build directory;
    # extension_build_lock).
    Fenced("torch.utils.cpp_extension", "_jit_compile"),
    Fenced("torch.utils._python_dispatch", "TorchDispatchMode"),  # the base of every dispatch mode; torch has no other
    Fenced("torch", "ops.aten._scaled_dot_product_flash_attention_for_cpu"),
    Fenced("torch", "ops.aten._scaled_dot_product_flash_attention"),
    Fenced("torch.distributed.tensor.experimental", "context_parallel",
           ("mesh", "buffers", "buffer_seq_dims", "no_restore_buffers")),
    Fenced("torch.distributed.pipelining.schedules", "get_schedule_class", ("schedule_name",)),
    Fenced("torch.distributed.pipelining.schedules", "_PipelineScheduleRuntime._load_csv",
           ("self", "filename", "format")),
    Fenced("torch.distributed.pipelining.schedules", "_PipelineScheduleRuntime._prepare_schedule_with_comms",
           ("self", "actions")),
    Fenced("torch.distributed.pipelining.schedules", "_validate_schedule",
           ("actions", "pp_group_size", "num_stages", "num_microbatches")),
    Fenced("torch.distributed.pipelining.schedules", "_Action",
           ("stage_index", "computation_type", "microbatch_index")),
    Fenced("torch.distributed.pipelining.schedules", "_ComputationType.FORWARD"),
    Fenced("torch.distributed.pipelining.schedules", "_ComputationType.FULL_BACKWARD"),
    Fenced("torch.distributed._functional_collectives", "wait_tensor", ("tensor",)),
    Fenced("torch.distributed._functional_collectives", "all_to_all_single_autograd",
           ("self", "output_split_sizes", "input_split_sizes", "group")),
    Fenced("torch.distributed.pipelining.stage", "_PipelineStageBase.backward_maybe_with_nosync",
           ("self", "backward_type", "bwd_kwargs", "last_backward")),
    Fenced("torch.distributed.pipelining.stage", "_PipelineStageBase.perform_reduce_grad",
           ("self", "grad_scale_factor")),
]


def forward_hook_tables(module: nn.Module) -> tuple[dict, dict]:
    """`module`'s forward pre-hooks and forward hooks, keyed by their handles' ids: a registered hook can be
    replaced in place, keeping its `with_kwargs`/`always_call` flags, only through these."""
    return module._forward_pre_hooks, module._forward_hooks


def checkpointed_module(module: nn.Module) -> nn.Module:
    """The module an activation-checkpoint wrapper runs, or `module` itself when it is not one."""
    return getattr(module, _CHECKPOINT_WRAPPED_MODULE, module)


def parameter_initialiser(module: nn.Module) -> Callable[[], None] | None:
    """How `module` initialises its own parameters: `reset_parameters()` (torch's convention), or the private one
    torch's MultiheadAttention has instead."""
    return getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)


def wrapped_module(wrapper: CheckpointWrapper) -> nn.Module:
    """The module an activation-checkpoint wrapper runs."""
    return wrapper._checkpoint_wrapped_module


def own_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """`module`'s own parameter table (not its children's), to read and to write: what `register_parameter` fills."""
    return module._parameters


def apply_to_tensors(module: nn.Module, function: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """`function` applied to every parameter and buffer, through the module (what `.to()` uses): FSDP2 re-points
    its sharded storage at the results. There is no public form that takes any function."""
    return module._apply(function)


def storage_identity(tensor: torch.Tensor) -> int:
    """An identity of `tensor`'s storage, shared by every tensor over it (views, and `_unsafe_view`s, which have no
    `_base`), on the meta device too (where every data pointer is 0). Unique only while the storage lives."""
    return tensor.untyped_storage()._cdata


def storage_owner(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage `tensor` views (itself if it is not a view)."""
    return tensor._base if tensor._base is not None else tensor


def fsdp_param_groups(unit: nn.Module) -> list[Any]:
    """FSDP2's records of one unit's parameters (sharding, offload, dtypes): none for a unit that holds none. torch
    2.12 turned the unit's one `_fsdp_param_group` into a list, `_fsdp_param_groups`, keeping the singular name as a
    property that raises once a unit has several."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []


def fully_sharded_units(module: nn.Module) -> list[nn.Module]:
    """The FSDP2 units in `module`: the modules `fully_shard` was applied to."""
    from torch.distributed.fsdp import FSDPModule

    return [unit for unit in module.modules() if isinstance(unit, FSDPModule)]


def fully_sharded_parameters(module: nn.Module) -> list[Any]:
    """FSDP2's per-parameter records (sharding, offload, mixed-precision dtypes) of every unit in `module`."""
    return [record for unit in fully_sharded_units(module) for group in fsdp_param_groups(unit)
            for record in group.fsdp_params]


def class_before_fully_shard(module: nn.Module) -> type[nn.Module]:
    """The class `module` was built as: `fully_shard` makes each unit an instance of a subclass of its own class."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    return next(base for base in cls.__bases__ if base is not FSDPModule) if isinstance(module, FSDPModule) else cls


def flatten_mesh_dims(mesh: DeviceMesh, dims: Sequence[str], name: str) -> DeviceMesh:
    """Make `mesh[name]` the 1-D mesh of `dims` flattened (HSDP's replicate x shard as one data-parallel axis).

    No public API: `DeviceMesh._flatten` is what torchtitan uses for the same purpose (its `dp` and `dp_cp`
    axes). It registers the flattened axis on the root mesh, so it can be looked up by name afterwards.
    """
    return mesh[tuple(dims)]._flatten(name)


def local_shard_region(param: Any) -> tuple[slice, ...]:
    """Where a DTensor parameter's local shard lies in the full tensor, as slices (uneven shards included).
    `distribute_tensor` would compute the same, but only by scattering a full tensor from a source rank."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, shape))


def local_tensor(dtensor: Any) -> torch.Tensor:
    """A DTensor's local shard, read from its slot. `to_local()` returns the same tensor through an autograd
    function: 7-10 us a call on our CPUs against 0.06, paid for every gradient of every step by the norm."""
    return dtensor._local_tensor


def reopen_fsdp_forward(model: nn.Module) -> None:
    """Mark an FSDP2 root (and its parameter groups) as still in forward. FSDP2 has no public way to say that a
    method which calls `forward` is itself the forward pass (see `parallel.fsdp.register_step_method`)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    for holder in (model._get_fsdp_state(), *fsdp_param_groups(model)):
        holder._training_state = TrainingState.FORWARD


@contextmanager
def parameter_registration(register: Callable[[nn.Module, str, Any], None]) -> Iterator[None]:
    """Within: `nn.Module.register_parameter`, through which every parameter a module is given passes, is
    `register`. How a model is built with its parameters on the meta device and its buffers real: torch's
    `torch.device("meta")` context puts every tensor there, buffers included."""
    replaced = nn.Module.register_parameter
    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = replaced


def set_default_process_group_timeout(timeout: timedelta) -> None:
    """Make `timeout` the default of every process group created from now on in this process. torch reads these
    module globals when `new_group` is called without a timeout (DeepSpeed does that); there is no setter."""
    from torch.distributed import distributed_c10d

    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout


def default_process_group_store() -> Any:
    """The store the default process group formed through (global rank 0's, or the torchrun agent's): every rank
    reaches it while the group is up. Raises where no process group is."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def cpu_supports_fp16() -> bool:
    """Whether oneDNN computes fp16 on this CPU (AVX512-FP16/AMX-FP16): the test DeepSpeed's CPU accelerator
    itself uses. False on a torch build without oneDNN."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def tree_map(function: Callable[[Any], Any], tree: Any) -> Any:
    """`function` applied to every leaf of nested lists, tuples and dicts (torch's pytree, which also knows
    namedtuples and the containers torch registers)."""
    from torch.utils._pytree import tree_map as _tree_map

    return _tree_map(function, tree)


def saved_file_extents(checkpoint_dir: str) -> dict[str, int]:
    """The files a torch.distributed.checkpoint directory's `.metadata` names, each with the bytes it must at least
    hold (its last entry's end). DCP has no public way to list them."""
    from torch.distributed.checkpoint import FileSystemReader

    extents: dict[str, int] = {}
    for where in (FileSystemReader(checkpoint_dir).read_metadata().storage_data or {}).values():
        extents[where.relative_path] = max(extents.get(where.relative_path, 0), where.offset + where.length)
    return extents


def read_entries(checkpoint_dir: str, prefix: str) -> dict[str, torch.Tensor]:
    """The tensor entries of a torch.distributed.checkpoint directory whose names start with `prefix`, each read
    alone (in this process, no process group) and keyed by the file that holds it."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(checkpoint_dir)
    metadata = reader.read_metadata()
    files = {index.fqn: where.relative_path for index, where in (metadata.storage_data or {}).items()}
    entries = {name: torch.empty(entry.size, dtype=entry.properties.dtype)
               for name, entry in metadata.state_dict_metadata.items()
               if name.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}
    if not entries:
        return {}
    nested: dict[str, Any] = {}
    for name, tensor in entries.items():  # as saved: {"save_id": {"rank0": ...}}
        parent, _, leaf = name.rpartition(".")
        nested.setdefault(parent, {})[leaf] = tensor
    load(nested, storage_reader=reader, no_dist=True)
    return {files[name]: tensor for name, tensor in entries.items()}


def is_compiled(module: nn.Module) -> bool:
    """Whether `module.compile()` has been called on `module` (it keeps the compiled call in `_compiled_call_impl`),
    or its forward alone was compiled (`compile_forward`)."""
    compiled_forward = hasattr(vars(module).get("forward"), "_torchdynamo_orig_callable")
    return getattr(module, "_compiled_call_impl", None) is not None or compiled_forward


COMPILED_PREFIX = "_orig_mod."  # where `torch.compile(module)`'s wrapper holds the module it compiled


def compiled_wrappers(module: nn.Module) -> list[nn.Module]:
    """The wrappers `torch.compile(m)` returned that sit in `module` (each holds `m` under `COMPILED_PREFIX`)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return [wrapper for wrapper in module.modules() if isinstance(wrapper, OptimizedModule)]


def eager() -> Any:
    """A context in which compiled code runs as the eager code it came from, compiling nothing."""
    return torch.compiler.set_stance("force_eager")


def compile_forward(module: nn.Module) -> None:
    """Compile `module`'s forward alone, in place: the hooks around it (`module(...)` runs them) stay outside the
    compiled code. `module.compile()` compiles the call with its hooks."""
    module.forward = torch.compile(module.forward)


def compilation_events(start: Callable[[], None], end: Callable[[], None]) -> None:
    """Call `start()` and `end()` around every compilation torch.compile does from now on in this process (a frame
    traced and compiled, or a backward graph compiled when backward first runs). Dynamo has these callbacks for tools
    that time compilation; no public API exposes them."""
    from torch._dynamo.callback import callback_handler

    callback_handler.register_start_callback(lambda arguments: start())
    callback_handler.register_end_callback(lambda arguments: end())


def inductor_cache_dir() -> str:
    """Where inductor keeps compiled graphs between runs (`TORCHINDUCTOR_CACHE_DIR`, else a directory in /tmp)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def is_view(tensor: torch.Tensor) -> bool:
    """Whether autograd sees `tensor` as a view of another (what FSDP2 warns about in a module's output)."""
    return tensor._base is not None


def version_of(tensor: torch.Tensor) -> int:
    """The counter autograd bumps at every in-place change of `tensor` (and of whatever it is a view of)."""
    return tensor._version


# FSDP2's warning, from torch 2.13, each time a sharded module's forward returns a view that requires grad:
# strategies/torch/output_views.py speaks instead, and only where an in-place change happened (the hazard it names).
FSDP_VIEW_OUTPUT_WARNING = r"FSDP2-wrapped module \(.*\) returned a view tensor"


def extension_build_lock(build_directory: Path) -> Path | None:
    """The file one process creates and holds open while it compiles (or checks) a JIT extension in
    `build_directory`, where every other process loading that extension waits until it is removed (torch's
    `FileBaton`, through 2.13). None where torch holds an OS advisory lock on that file instead (2.14 on): the kernel
    releases it when its holder ends, and the file, which stays, blocks nothing."""
    from torch.utils import cpp_extension

    return build_directory / "lock" if hasattr(cpp_extension, "FileBaton") else None


def cpu_flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                        dropout_p: float, is_causal: bool, scale: float | None) -> torch.Tensor:
    """Attention by CPU's fused (flash) kernel, whatever the tensors' device: it has meta and autograd kernels, and
    saves for backward what the CUDA fused kernels save. `scaled_dot_product_attention` picks it only for CPU
    tensors."""
    output, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return output


def cuda_flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float,
                         is_causal: bool, scale: float | None) -> torch.Tensor:
    """Attention by CUDA's flash kernel, the one torch's ring attention has a rule for (on fake CUDA tensors: its meta
    kernel; on DTensors: the ring)."""
    return torch.ops.aten._scaled_dot_product_flash_attention(
        query, key, value, dropout_p, is_causal, False, scale=scale)[0]


@contextmanager
def ring_attention(mesh: DeviceMesh, length: int, device: Any) -> Iterator[torch.Tensor]:
    """Within: torch's context-parallel attention (its ring over `mesh`, the context-parallel ranks) wherever
    `F.scaled_dot_product_attention` is called by that name. Yields the positions of a `length`-token sequence that
    this rank holds, in torch's order: its causal load balancing gives rank r the chunks r and 2 x cp - 1 - r of
    2 x cp (torch shards an `arange` buffer as it would shard the batch, so the two cannot differ)."""
    from torch.distributed.tensor.experimental import context_parallel

    positions = torch.arange(length, device=device)[None]
    with context_parallel(mesh, buffers=[positions], buffer_seq_dims=[1], no_restore_buffers={positions}):
        yield positions[0]


@contextmanager
def attention_function_replaced(replacement: Callable[..., torch.Tensor]) -> Iterator[Callable[..., torch.Tensor]]:
    """Within: `torch.nn.functional.scaled_dot_product_attention` is `replacement` (models call it by that name, in
    forward and in the recomputation of checkpointed blocks). Yields the original."""
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = replacement
    try:
        yield original
    finally:
        F.scaled_dot_product_attention = original


@contextmanager
def autocast_on_meta() -> Iterator[None]:
    """Within: `torch.autocast(device_type="meta", ...)` is a context that does nothing, as autocast on a device
    without it would; torch refuses it ("unsupported scalarType"), and PEFT's LoRA on fused experts enters it on its
    weights' device, which a trace on the meta device (the memory plan's) makes meta."""
    original = torch.autocast

    def autocast(device_type: str, *args: Any, **kwargs: Any) -> Any:
        return nullcontext() if device_type == "meta" else original(device_type, *args, **kwargs)

    torch.autocast = autocast
    try:
        yield
    finally:
        torch.autocast = original


@contextmanager
def checkpoint_loads_in_one_process() -> Iterator[Callable[[], int]]:
    """Within: `torch.distributed.checkpoint.load` (which Lightning's sharded load calls by that name) reads as one
    process does (`no_dist=True`): for a world of one rank, where its plan exchange over gloo slows the rest of the
    run (checkpoints/background.py says how). Yields the number of loads it has read so."""
    import torch.distributed.checkpoint as dcp

    original, loads = dcp.load, []

    def load(*args: Any, **kwargs: Any) -> Any:
        loads.append(1)
        return original(*args, **{**kwargs, "no_dist": True})

    dcp.load = load
    try:
        yield lambda: len(loads)
    finally:
        dcp.load = original


_aten = torch.ops.aten
# Ops whose output's size (or Python result) depends on the values: the host waits for the device to run them.
_DATA_DEPENDENT = frozenset({
    _aten.nonzero.default, _aten.masked_select.default, _aten._unique2.default, _aten.unique_dim.default,
    _aten.unique_consecutive.default, _aten.equal.default, _aten.is_nonzero.default, _aten.bincount.default,
    _aten.repeat_interleave.Tensor,
})


def host_sync_kind(func: Any, args: tuple, kwargs: dict) -> str | None:
    """What a dispatched op makes the host wait for, or None: "read" (a value read on the host: `.item()`,
    `float(t)`, `bool(t)`), "data-dependent" (an output sized by the values), "copy to host" (from a device)."""
    if func is _aten._local_scalar_dense.default:
        return "read"
    if func in _DATA_DEPENDENT:
        return "data-dependent"
    if func is _aten._to_copy.default:
        target = kwargs.get("device")
        to_host = target is not None and torch.device(target).type == "cpu" and args[0].device.type != "cpu"
        return "copy to host" if to_host else None
    if func is _aten.copy_.default:
        destination, source = args[0], args[1]
        to_host = destination.device.type == "cpu" and isinstance(source, torch.Tensor) and source.device.type != "cpu"
        return "copy to host" if to_host else None
    return None


def pipeline_schedule(name: str, stages: list[Any], microbatches: int, loss_fn: Callable[..., torch.Tensor],
                      multi_stage: bool) -> Any:
    """torch's schedule `name` over this rank's `stages` (one, for a single-stage schedule), or the one a CSV file
    writes out (`_PipelineScheduleRuntime._load_csv`, private in every release). Gradients are not scaled by the
    schedule: the loss function divides by the microbatches, so that gradients accumulated over several batches
    (Lightning's `accumulate_grad_batches`) are not divided again at each."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime, get_schedule_class

    if name.endswith(".csv"):
        # The runtime lowers the file's compute actions to sends, receives and FSDP's gathers, as torch's own
        # multi-stage schedules are (`pipeline_order_with_comms`); the base class would keep the bare actions.
        schedule = _PipelineScheduleRuntime(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
        schedule._load_csv(name)
        return schedule
    schedule_class = get_schedule_class(name)
    return schedule_class(stages if multi_stage else stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)


def forward_only_order(schedule: Any, stage_to_rank: Callable[[int], int], stages: int, microbatches: int,
                       ranks: int) -> Any:
    """A multi-stage `schedule`'s actions for a forward-only pass over `microbatches`, lowered by the schedule itself
    (`_prepare_schedule_with_comms`: FSDP's gathers, the sends and receives, and from 2.15 the waits on sends):
    each rank runs its stages' forwards microbatch by microbatch, in stage order. torch's `eval()` runs a
    multi-stage schedule's own actions, backward ones included, and fails on a V schedule's adjacent stages
    (ZBVZeroBubble, DualPipeV: "can't steal_bwd_input if this stage doesn't have backward"). The schedule's check
    of an order (`_validate_schedule`) refuses one without backward; it is passed over here, keeping the schedule's
    placement of stages. The schedule's own order and count are left as they were."""
    from torch.distributed.pipelining import schedules

    forward = schedules._ComputationType.FORWARD
    actions = {
        rank: [schedules._Action(stage, forward, microbatch) for microbatch in range(microbatches)
               for stage in range(stages) if stage_to_rank(stage) == rank]
        for rank in range(ranks)
    }
    own = schedule.pipeline_order_with_comms, schedule._n_microbatches
    check = schedules._validate_schedule
    placement = dict(schedule.stage_index_to_group_rank)
    schedules._validate_schedule = lambda *args, **kwargs: placement
    try:
        schedule._n_microbatches = microbatches
        schedule._prepare_schedule_with_comms(actions)
        return schedule.pipeline_order_with_comms
    finally:
        schedules._validate_schedule = check
        schedule.pipeline_order_with_comms, schedule._n_microbatches = own


@contextmanager
def running_order(schedule: Any, order: Any, microbatches: int) -> Iterator[None]:
    """`schedule` running the lowered actions `order` (`forward_only_order`) over `microbatches` instead of its
    own actions and count (`_n_microbatches`, which splits the batch; private in every release)."""
    own = schedule.pipeline_order_with_comms, schedule._n_microbatches
    schedule.pipeline_order_with_comms, schedule._n_microbatches = order, microbatches
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms, schedule._n_microbatches = own


def rank_actions(schedule: Any, rank: int) -> list[tuple[int, str, int]]:
    """A multi-stage `schedule`'s own actions for pipeline rank `rank`, as (stage, "F" or "B" or another of torch's
    computation types, microbatch), idle slots left out (`pipeline_order`, before sends and receives are added)."""
    from torch.distributed.pipelining import schedules

    names = {schedules._ComputationType.FORWARD: "F", schedules._ComputationType.FULL_BACKWARD: "B"}
    return [(action.stage_index, names.get(action.computation_type, str(action.computation_type)),
             action.microbatch_index) for action in schedule.pipeline_order[rank] if action is not None]


def stage_backward(stage: Any, output: Any, output_grads: Any, inputs: tuple) -> None:
    """`stage`'s backward of one microbatch as its schedule runs it: under FSDP, without reducing gradients or
    resharding the stage (it stays gathered until `stage_reduce_gradients`)."""
    stage.backward_maybe_with_nosync("full", {"stage_output": output, "output_grads": output_grads,
                                              "input_values": inputs}, last_backward=False)


def stage_reduce_gradients(stage: Any) -> None:
    """What `stage`'s schedule runs after its last backward of a step: FSDP's reduction of the gradients, and the
    stage resharded (gradients unscaled: the loss function divides them)."""
    stage.perform_reduce_grad(1)


def all_to_all_with_gradients(chunks: torch.Tensor, group: Any, output_splits: list[int] | None = None,
                              input_splits: list[int] | None = None) -> torch.Tensor:
    """Chunk i of `chunks`' first dimension to rank i of `group`, and theirs back, differentiable (backward sends
    the gradients the reverse way): torch's functional collective (`torch.distributed.nn.functional`'s is
    deprecated). Equal chunks, or `input_splits[i]` rows to rank i and `output_splits[i]` from it. Waited for here:
    the next op needs it."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(chunks, output_splits, input_splits, group))


@contextmanager
def own_parameters_as(module: nn.Module, values: dict[str, torch.Tensor]) -> Iterator[None]:
    """`module`'s own parameters named in `values` read as those tensors (plain ones: a DTensor's local part) while
    inside, then as they were. No public way: `torch.func.functional_call` would call the module, running its
    hooks (FSDP's) a second time; transformers swaps them the same way (`_use_local_dtensor_params`)."""
    held = {name: module._parameters[name] for name in values}
    module._parameters.update(values)  # type: ignore[arg-type]  # plain tensors where Parameters are expected
    try:
        yield
    finally:
        module._parameters.update(held)


def runs_v_schedules() -> bool:
    """Whether this torch's pipeline stages can hold two adjacent stages on one rank (the V schedules,
    ZBVZeroBubble and DualPipeV). 2.11's stage warm-up sends a message to each neighbouring stage's rank, its own
    included, which gloo refuses ("Pair is not connected"); 2.13 and 2.15 pass a same-rank neighbour's messages in
    memory, which their stages know to do (`_is_same_rank`, absent from 2.11's). Checked on 2.11.0, 2.13.0, 2.15.0."""
    from torch.distributed.pipelining import PipelineStage

    return hasattr(PipelineStage, "_is_same_rank")
