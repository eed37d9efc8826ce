"""DeepSpeed internals and the patches we apply to it. Checked on deepspeed 0.19.8 (pinned in pyproject.toml:
the patches replace functions with the exact signatures of that release)."""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import re
import socket
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

from lightning_dist._compat.fenced import Fenced

FENCED = [
    Fenced(
        "deepspeed.utils.zero_to_fp32",
        "_get_fp32_state_dict_from_zero2_checkpoint",
        ("world_size", "fp32_flat_groups", "zero_model_states", "exclude_frozen_parameters"),
    ),
    Fenced(
        "deepspeed.utils.zero_to_fp32",
        "_get_fp32_state_dict_from_zero3_checkpoint",
        ("world_size", "fp32_flat_groups", "zero_model_states", "exclude_frozen_parameters"),
    ),
    # A parameter made a ZeRO-3 one and partitioned, each rank writing only its partition (partition below).
    Fenced("deepspeed.runtime.zero.partition_parameters", "Init._convert_to_deepspeed_param", ("self", "param")),
    Fenced("deepspeed.runtime.zero.partition_parameters", "Init._aligned_size", ("self", "param")),
    Fenced("deepspeed.runtime.zero.partition_parameters", "Init._partition_world_size", ("self", "param")),
    Fenced("deepspeed.runtime.zero.partition_parameters", "Init._partition_rank", ("self", "param")),
    Fenced("deepspeed.runtime.zero.partition_parameters", "InsertPostInitMethodToModuleSubClasses"),
    Fenced("deepspeed.runtime.zero.linear", "zero3_linear_wrap"),
    Fenced(
        "deepspeed.runtime.swap_tensor.partitioned_param_swapper",
        "AsyncPartitionedParameterSwapper.swap_in",
        ("self", "params", "async_op", "swap_in_buffers"),
    ),
    Fenced("deepspeed.runtime.compiler", "compile"),
    Fenced(
        "deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state", ("self",)
    ),
    Fenced("deepspeed.runtime.engine", "DeepSpeedEngine.load_checkpoint", ("self", "load_dir")),
    # What reads the clipping norm (clip_steps_at below): the ZeRO optimizers' `clip_grad`, the plain engine's config.
    Fenced("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.unscale_and_clip_grads",
           ("self", "grad_groups_flat", "total_norm")),
    Fenced("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3.unscale_and_clip_grads"),  # (nvtx-wrapped)
    Fenced("deepspeed.runtime.engine", "DeepSpeedEngine.gradient_clipping", ("self",)),
    # The op builders' compile flags, which ask py-cpuinfo (remember_cpu_info below).
    Fenced("deepspeed.ops.op_builder.builder", "OpBuilder.cpu_arch", ("self",)),
    Fenced("deepspeed.ops.op_builder.builder", "OpBuilder.simd_width", ("self",)),
    Fenced("cpuinfo", "get_cpu_info", ()),
    # Reads a config dict key by key (top_level_config_keys below).
    Fenced("deepspeed.runtime.config", "DeepSpeedConfig.__init__", ("self", "config", "mpu")),
    # AutoTP's sum over the tensor-parallel group of a replicated layer's gradient, and its mark that the hook is in
    # place (sum_gradient_over_group below).
    Fenced("deepspeed.module_inject.auto_tp", "AutoTP.register_replicated_grad_hooks", ("self", "model")),
    # The names under which AutoTP's rules take a layer for a fused q/k/v projection (splits_as_fused_qkv below).
    Fenced("deepspeed.module_inject.fusedqkv_utils", "require_tp_fused_qkvw", ("name", "mp_size")),
    # AutoTP's first-forward input check, a hook whose handle the engine keeps (replace_tensor_parallel_input_check).
    Fenced("deepspeed.runtime.engine", "DeepSpeedEngine._configure_tensor_parallel_states", ("self", "model")),
    # Compiles an op on first use (around_op_loads below), into torch's extension directory.
    Fenced("deepspeed.ops.op_builder.builder", "OpBuilder.jit_load", ("self", "verbose")),
    Fenced("torch.utils.cpp_extension", "_get_build_directory", ("name", "verbose")),
    # Builds the shared-memory comm op as the comm backend starts (skip_shared_memory_comm_op below).
    Fenced("deepspeed.comm.torch", "build_shm_op", ()),
    Fenced("deepspeed.comm.torch", "TorchBackend.inference_all_reduce", ("self", "tensor", "op", "group")),
    # The classes a ZeRO checkpoint pickles besides tensors (zero_checkpoint_globals below).
    Fenced("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    Fenced("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    Fenced("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    Fenced("deepspeed.utils.tensor_fragment", "fragment_address"),
    Fenced("deepspeed.runtime.zero.partition_parameters", "GatheredParameters"),
    # The ZeRO optimizers' test of the gradient norm after every step, a read on the host (read_gradient_norm_on_host).
    Fenced("deepspeed.runtime.utils", "is_invalid_grad_norm", ("norm",)),
    Fenced("deepspeed.runtime.zero.stage_1_and_2", "is_invalid_grad_norm", ("norm",)),
    Fenced("deepspeed.runtime.zero.stage3", "is_invalid_grad_norm", ("norm",)),
    # ZeRO-1/2's own tests for non-finite gradients (overflow_tested_on_host): the first runs before each step where
    # its `check_grad_overflow` is set.
    Fenced("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.check_overflow", ("self",)),
    Fenced("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.update_offload_overflow_tracker", ("self",)),
    # The groups DeepSpeed keeps after the process group is gone (forget_process_groups).
    Fenced("deepspeed.utils.groups", "_release_process_group_references", ("group",)),
    # What AutoEP asks of transformers' registry of recorded outputs (autoep_reads_transformers_outputs).
    Fenced("deepspeed.module_inject.auto_ep_presets.base", "_install_instance_transformers_output_recorders",
           ("model", "registry_entries", "output_capturing", "remove_output_capture_hooks")),
]

_NORM_TESTERS = ("deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.zero.stage3")


def read_gradient_norm_on_host(read: bool) -> None:
    """Whether the ZeRO optimizers read the gradient norm on the host after every step to skip a step whose norm is
    not finite (DeepSpeed's way; `bool(tensor)`, on a GPU a wait for the device every step), or take every step and
    leave the norm, a tensor on the device, to be judged by whoever asks for it (the training monitor's non-finite
    stop, within its `check_every_n_steps`). Not for fp16 training: its loss scaler learns from the skipped steps.
    A norm that is not a tensor is still tested (it is on the host already)."""
    import importlib

    from deepspeed.runtime.utils import is_invalid_grad_norm

    def judged_elsewhere(norm: Any) -> bool:
        return False if torch.is_tensor(norm) else is_invalid_grad_norm(norm)

    for name in _NORM_TESTERS:
        importlib.import_module(name).is_invalid_grad_norm = is_invalid_grad_norm if read else judged_elsewhere


def overflow_tested_on_host(optimizer: Any, tested: bool) -> None:
    """Whether ZeRO-1/2's `optimizer` tests its gradients for non-finite values before every step, as DeepSpeed does
    under bf16 (`bf16.check_grad_overflow`: a flag all-reduced and read on the host), and, with the optimizer
    offloaded, tests each gradient as it leaves for the host (a read per parameter), or leaves that to the caller
    (see read_gradient_norm_on_host). ZeRO-3 tests only under fp16; its optimizer has neither."""
    if not hasattr(optimizer, "check_grad_overflow"):
        return
    kept = optimizer.__dict__.setdefault("_check_grad_overflow_as_configured", optimizer.check_grad_overflow)
    optimizer.check_grad_overflow = kept if tested else False
    if tested:
        optimizer.__dict__.pop("update_offload_overflow_tracker", None)
    else:
        optimizer.update_offload_overflow_tracker = lambda grad: None


def forget_process_groups() -> None:
    """Drop the process groups DeepSpeed cached (its world group's clone, the data-parallel group), once torch's are
    destroyed: a later DeepSpeed run in this interpreter (a notebook's next cell, a sweep's next job) would otherwise
    hand ZeRO a group of the closed world ("Group ... is not registered"). What `deepspeed.comm.destroy_process_group`
    does after destroying, for a group closed through torch."""
    import importlib

    importlib.import_module("deepspeed.utils.groups")._release_process_group_references(group=None)


def skip_shared_memory_comm_op() -> None:
    """Start DeepSpeed's comm backend without its shared-memory op. DeepSpeed builds it whenever the backend starts
    on the CPU (a JIT compile of a minute or more on first use, into a cache that every node of a cluster with a
    shared home directory compiles into and locks), but only `TorchBackend.inference_all_reduce` uses it, which
    training never calls, and which falls back to torch's all_reduce without it; ranks on different machines could
    not share memory anyway."""
    import importlib

    # Not `import deepspeed.comm.torch`: that name is torch itself, which deepspeed.comm imports under it.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def zero_checkpoint_globals() -> list[Any]:
    """What DeepSpeed's ZeRO optimizer states pickle besides tensors: plain record and enum classes."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextmanager
def zero3_gathered(parameters: list[torch.nn.Parameter]) -> Iterator[None]:
    """Within: ZeRO-3's partitioned `parameters` whole on every rank (read only: nothing is written back)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(parameters, modifier_rank=None):
        yield


def merge_zero_partitions(
    stage: int, world_size: int, flat_groups: list, model_states: list, padding: Any = None
) -> dict:
    """Per-parameter tensors from ZeRO's flat per-rank partitions, by DeepSpeed's own merge (the one its
    `zero_to_fp32` script uses for the fp32 master weights); any flat state of the same layout merges alike."""
    from deepspeed.utils import zero_to_fp32

    if stage <= 2:
        return zero_to_fp32._get_fp32_state_dict_from_zero2_checkpoint(
            world_size, flat_groups, model_states, True, padding
        )
    return zero_to_fp32._get_fp32_state_dict_from_zero3_checkpoint(world_size, flat_groups, model_states, True)


def partition_elements(init: Any, param: torch.nn.Parameter) -> tuple[int, int]:
    """The elements [start, end) of `param`, flattened, that this rank's ZeRO-3 partition will hold, as
    `deepspeed.zero.Init` lays them out (`_convert_to_deepspeed_param`'s group, `_partition_param`'s padded even
    split), known before the parameter holds any memory. Checked against DeepSpeed's own by `partition`."""
    import torch.distributed as dist

    group = getattr(param, "ds_zero_partition_process_group", init.ds_process_group)
    ranks, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
    size = -(-param.numel() // ranks)  # the numel padded to a multiple of the ranks, split evenly
    return min(size * rank, param.numel()), min(size * (rank + 1), param.numel())


def partition(init: Any, param: torch.nn.Parameter, value: torch.Tensor, value_start: int) -> None:
    """What `deepspeed.zero.Init` does to a parameter at the end of its module's constructor (make it a ZeRO-3
    parameter and keep this rank's partition), without entering the context, which would patch every module class's
    constructor, and without its broadcast from rank 0: every rank holds the same values (read from the same files,
    or drawn from the same seed). `param` holds memory of its full size, unwritten; `value` is its elements from
    `value_start` on (flattened), at least those of this rank's partition (`partition_elements`), which go straight
    into the partition, so that a rank never writes the rest. RuntimeError where DeepSpeed's own layout put other
    elements in this rank's partition."""
    elements = partition_elements(init, param)
    param.data = param.data.to(init.local_device)
    init._convert_to_deepspeed_param(param)
    size = init._aligned_size(param) // init._partition_world_size(param)
    start = size * init._partition_rank(param)
    if (min(start, param.ds_numel), min(start + size, param.ds_numel)) != elements:
        raise RuntimeError(f"DeepSpeed {version('deepspeed')} puts elements {start}-{start + size} of a"
                           f" {tuple(param.ds_shape)} parameter in this rank's ZeRO-3 partition, where lightning_dist"
                           f" expects {elements[0]}-{elements[1]}: its layout changed, and"
                           " lightning_dist/_compat/deepspeed.py needs the new one")
    needed = (0, param.ds_numel) if partitions_from_whole_parameters(init) else elements
    if value_start > needed[0] or value_start + value.numel() < needed[1]:
        raise RuntimeError(f"elements {value_start}-{value_start + value.numel()} of a {tuple(param.ds_shape)}"
                           f" parameter were read for a ZeRO-3 partition of elements {needed[0]}-{needed[1]}")
    if partitions_from_whole_parameters(init):
        param.data.view(-1).copy_(value.reshape(-1))
        param.partition()
        return
    kept = value.reshape(-1)[elements[0] - value_start:elements[1] - value_start]
    # Into the partition once made, unless it leaves the rank's memory as it is made (NVMe) or is stored quantized:
    # then through the parameter's own memory first.
    if init.remote_device == "nvme" or init.quantized_nontrainable_weights:
        param.data.view(-1)[elements[0]:elements[1]].copy_(kept)
        param.partition()
    else:
        param.partition()
        param.ds_tensor.narrow(0, 0, len(kept)).copy_(kept)


def partitions_from_whole_parameters(init: Any) -> bool:
    """Whether each rank needs a parameter's every element to partition it: ZeRO++'s hierarchical partitioning (hpZ,
    `zero_hpz_partition_size`) keeps a second, larger partition per node beside the rank's own."""
    return init.zero_param_process_group is not None


def use_zero3_linear() -> None:
    """What entering `deepspeed.zero.Init` does, and leaves in place: `torch.nn.functional.linear` replaced by
    ZeRO-3's own (see `parallel.zero3_runtime`). Kept where DeepSpeed keeps torch's, so its exit restores it."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as patcher

    if not hasattr(patcher, "linear_bk"):
        patcher.linear_bk = torch.nn.functional.linear
    if torch.nn.functional.linear is patcher.linear_bk:
        torch.nn.functional.linear = zero3_linear_wrap


def patch_swap_in(wrap: Callable[[Callable], Callable]) -> None:
    """Replace NVMe's `AsyncPartitionedParameterSwapper.swap_in` by `wrap(swap_in)`, once per process."""
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import AsyncPartitionedParameterSwapper as swapper

    if getattr(swapper.swap_in, "patched_by_lightning_dist", False):
        return
    patched = functools.wraps(swapper.swap_in)(wrap(swapper.swap_in))
    patched.patched_by_lightning_dist = True
    swapper.swap_in = patched


@contextmanager
def compile_replaced_by(replacement: Callable) -> Iterator[None]:
    """Within: DeepSpeed's `compiler.compile()` (the decorator factory its modules call at import) returns
    `replacement` instead of `torch.compile`."""
    from deepspeed.runtime import compiler

    eager = compiler.compile
    compiler.compile = lambda: replacement
    try:
        yield
    finally:
        compiler.compile = eager


def point_parameters_at_optimizer_state(optimizer: Any) -> None:
    """ZeRO-1/2: after its state was written by hand, let each parameter find its slices of it again (what
    DeepSpeed does lazily on its first step)."""
    if hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
        optimizer._lazy_init_hp_params_optimizer_state()


def clip_steps_at(engine: Any, max_norm: float) -> None:
    """The global gradient norm DeepSpeed's `engine` clips to in its steps from now on (0: none). The optimizers it
    wraps under ZeRO, bf16 or fp16 clip by their own `clip_grad`: a copy of the config's gradient_clipping taken when
    they are built, which ZeRO-1/2's, bf16's and fp16's `load_state_dict` replace with the checkpoint's. Without one,
    the engine clips by its config."""
    optimizer = engine.optimizer
    if hasattr(optimizer, "clip_grad"):
        if max_norm > 0 and getattr(optimizer, "compute_grad_norm", True) is False:
            raise ValueError(
                f"gradient clipping at {max_norm}: the DeepSpeed config's zero_optimization.compute_grad_norm=false "
                "leaves no norm to clip by; remove it"
            )
        optimizer.clip_grad = float(max_norm)
    elif engine.zero_optimization() or engine.fp16_enabled() or engine.bfloat16_enabled():
        raise RuntimeError(
            f"DeepSpeed {version('deepspeed')}'s {type(optimizer).__name__} keeps no clip_grad: lightning-dist cannot "
            "set the norm it clips to"
        )
    else:
        engine._config.gradient_clipping = float(max_norm)


@contextmanager
def universal_checkpoint_loading(engine: Any) -> Iterator[None]:
    """Within: `engine.load_checkpoint` reads the universal form. The flag lives only in the engine's parsed
    config (there is no argument for it); saves read it too, so it is set for the load only."""
    config = engine._config
    config.load_universal_checkpoint = True
    try:
        yield
    finally:
        config.load_universal_checkpoint = False


# The machine's py-cpuinfo answer, for the processes this one starts on the same host.
CPU_INFO_ENV = "LIGHTNING_DIST_CPU_INFO"


def remember_cpu_info() -> None:
    """Ask py-cpuinfo once per job, not twice per native op per rank.

    DeepSpeed's CPU op builders compute their compile flags (which decide whether the cached build is reused) from
    `cpuinfo.get_cpu_info()`, once in `cpu_arch` and once in `simd_width`, every time a process loads an op. Each
    call starts a Python process of its own: 1.1 s on our machines, so 2.2 s per rank before an offload run's rank
    joins. The answer is the machine's: remembered in this process, and handed through the environment to the ranks
    it starts on this host. DeepSpeed imports the function when it calls it (op_builder/builder.py), so replacing
    the module's attribute reaches it; there is no option for it. Checked on deepspeed 0.19.8, py-cpuinfo 9.0.0."""
    import cpuinfo

    if getattr(cpuinfo.get_cpu_info, "patched_by_lightning_dist", False):
        return
    ask = cpuinfo.get_cpu_info
    host = socket.gethostname()

    @functools.wraps(ask)
    def get_cpu_info() -> dict[str, Any]:
        try:
            record = json.loads(os.environ.get(CPU_INFO_ENV, "{}"))
        except ValueError:
            record = {}
        if record.get("host") != host or not isinstance(record.get("info"), dict):
            record = {"host": host, "info": ask()}
            os.environ[CPU_INFO_ENV] = json.dumps(record)
        return copy.deepcopy(record["info"])

    get_cpu_info.patched_by_lightning_dist = True
    cpuinfo.get_cpu_info = get_cpu_info


class _RecordingConfig(dict):
    """A config dict that records every top-level key read from it, however it is asked (DeepSpeed uses `get`,
    `[]`, `in` and `in .keys()`)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.read: set[str] = set()

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        self.read.add(key)
        return super().__contains__(key)

    def keys(self) -> Any:
        return _RecordingKeys(self)


class _RecordingKeys:
    def __init__(self, config: _RecordingConfig) -> None:
        self.config = config

    def __contains__(self, key: Any) -> bool:
        return key in self.config

    def __iter__(self) -> Iterator[Any]:
        return dict.__iter__(self.config)

    def __len__(self) -> int:
        return dict.__len__(self.config)


@functools.cache
def top_level_config_keys() -> frozenset[str]:
    """The top-level keys of a DeepSpeed config that DeepSpeed reads. DeepSpeed has no schema for the top level
    (its sections are pydantic models; the top is read key by key, and an unknown key is ignored), so its config
    class parses a minimal config, batch sizes only, and every key it asks for is recorded."""
    from deepspeed.runtime.config import DeepSpeedConfig

    config = _RecordingConfig({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1})
    DeepSpeedConfig(config)
    return frozenset(key for key in config.read if isinstance(key, str))


# DeepSpeed names a data-parallel rank's files `[bf16_]zero_pp_rank_<rank>_mp_rank_<mp>_<kind>.pt`
# (DeepSpeedEngine._get_rank_zero_ckpt_name, _get_ckpt_name) and records the world size as `dp_world_size` in every
# model-states file.
_RANK_IN_NAME = re.compile(r"zero_pp_rank_(\d+)_")


def missing_rank_files(tag_dir: Path, model_states: dict[str, Any]) -> list[Path]:
    """The per-rank files of a DeepSpeed checkpoint that its saved world size names and the directory lacks: for
    every kind of per-rank file present (optimizer states; ZeRO-3's model states), one per data-parallel rank."""
    world_size = int(model_states.get("dp_world_size") or 1)
    ranks_by_kind: dict[str, set[int]] = {}
    for file in tag_dir.glob("*zero_pp_rank_*.pt"):
        if found := _RANK_IN_NAME.search(file.name):
            ranks_by_kind.setdefault(_RANK_IN_NAME.sub("zero_pp_rank_{}_", file.name), set()).add(int(found[1]))
    return [tag_dir / kind.format(rank) for kind, ranks in sorted(ranks_by_kind.items())
            for rank in range(world_size) if rank not in ranks]


def saved_steps(per_rank_file: dict[str, Any]) -> set[int]:
    """The steps a per-rank file of a DeepSpeed checkpoint says it was saved at: ZeRO-3's model states record the
    engine's `global_steps`; an optimizer-states file holds each partition's optimizer state, whose `step` counts
    the optimizer's steps (ZeRO-1/2 under `base_optimizer_state`, ZeRO-3 under `optimizer_state_dict`), which is
    `global_steps` less the `skipped_steps` (fp16 overflows) the model states record. Empty where neither is held
    (an optimizer without a step count)."""
    if "global_steps" in per_rank_file:
        return {int(per_rank_file["global_steps"])}
    found: set[int] = set()

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            if "step" in value and "exp_avg" in value:  # one parameter partition's Adam-style state
                found.add(int(value["step"]))
                return
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(per_rank_file.get("optimizer_state_dict"))
    return found


def replace_tensor_parallel_input_check(engine: Any, check: Callable[..., None]) -> Any:
    """Removes the forward pre-hook that AutoTP's engine registers to compare the first inputs across a tensor-parallel
    group (`first_dataloader_check`), and registers `check(module, args, kwargs)` in its place; returns its handle."""
    if engine.first_dataloader_check is not None:
        engine.first_dataloader_check.remove()
    engine.first_dataloader_check = engine.module.register_forward_pre_hook(check, prepend=True, with_kwargs=True)
    return engine.first_dataloader_check


# AutoTP's mark on a parameter whose gradient it sums (AutoTP.register_replicated_grad_hooks).
_SUMMED_MARK = "_ds_grad_allreduce_registered"


def sum_gradient_over_group(param: torch.nn.Parameter, group: Any) -> None:
    """Sums `param`'s gradient over `group` as it is computed, before it is accumulated (and before ZeRO's hooks
    reduce it over the data-parallel ranks), as AutoTP does for the layers of a Hugging Face plan; marked as AutoTP
    marks it, so that neither registers a second sum."""
    if getattr(param, _SUMMED_MARK, False):
        return
    import torch.distributed as dist

    def summed(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=group)
        return grad

    param.register_hook(summed)
    setattr(param, _SUMMED_MARK, True)


def gradient_summed_over_group(param: torch.nn.Parameter) -> bool:
    return bool(getattr(param, _SUMMED_MARK, False))


def splits_as_fused_qkv(name: str, size: int) -> bool:
    """Whether AutoTP at `size` ranks splits the layer `name` as a fused q/k/v projection (its fused-QKV code, which
    guesses the heads' layout from the class of the layer's block)."""
    from deepspeed.module_inject.fusedqkv_utils import require_tp_fused_qkvw

    return bool(require_tp_fused_qkvw(name, size))


def op_build_directory(name: str) -> Path:
    """Where torch compiles and caches extension `name` (TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions/...)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def op_is_built(name: str) -> bool:
    return (op_build_directory(name) / f"{name}.so").is_file()


def around_op_loads(around_load: Callable[[str], AbstractContextManager[object]]) -> None:
    """Every load of a DeepSpeed native op this process has not loaded yet (a compile of minutes on first use, or a
    wait on another process's) runs inside `around_load(op name)`; lightning_dist/lifecycle/op_builds.py says what
    happens there. Idempotent: the first caller's `around_load` stays."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    if getattr(OpBuilder.jit_load, "announces_builds", False):
        return
    jit_load = OpBuilder.jit_load

    @functools.wraps(jit_load)
    def announced(self: Any, verbose: bool = True) -> Any:
        if self.name in OpBuilder._loaded_ops:
            return jit_load(self, verbose)
        with around_load(self.name):
            return jit_load(self, verbose)

    announced.announces_builds = True
    OpBuilder.jit_load = announced


def say_on_local_rank_zero(line: str) -> None:
    """One line per machine: the ranks of a node share the cache, and wait on the one that builds."""
    import sys

    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)


# The dry run of a ZeRO engine (lightning_dist/strategies/deepspeed/dry_run.py), over torch's fake process group.
FENCED += [
    Fenced("deepspeed.runtime.zero.utils", "assert_ints_same_as_other_ranks"),  # (ints); its profiler wrapper hides it
    Fenced("deepspeed.runtime.zero.partition_parameters", "assert_ints_same_as_other_ranks"),
    Fenced("deepspeed.runtime.zero.partitioned_param_coordinator", "assert_ints_same_as_other_ranks"),
    Fenced("deepspeed.utils.groups", "_WORLD_GROUP"),
    Fenced("deepspeed.comm.comm", "cdb"),
    Fenced("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3"),
    # (self, current_submodule, forward); its profiler wrapper hides them
    Fenced("deepspeed.runtime.zero.partitioned_param_coordinator", "PartitionedParameterCoordinator.fetch_sub_module"),
    Fenced("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.setup_buckets", ("self",)),
]
# Where ZeRO-3's optimizer keeps each parameter's gradient partition (a view of one flat buffer, when contiguous).
_ZERO3_GRADIENT_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"


@contextmanager
def over_a_fake_process_group() -> Iterator[None]:
    """Within: DeepSpeed sets up and steps over torch's fake process group, as one rank, and forgets it after.
    ZeRO-3 checks that ranks agree on a list by broadcasting rank 0's and comparing: nothing arrives over the fake
    group, so the check is skipped. DeepSpeed keeps the process groups it made (and its comm backend) in module
    globals, which an earlier run in this process may have left pointing at groups long gone: they start empty
    here, and are put back as they were after."""
    import importlib
    from unittest import mock

    groups = importlib.import_module("deepspeed.utils.groups")
    comm = importlib.import_module("deepspeed.comm.comm")
    caches = {name: value for name, value in vars(groups).items()
              if name.startswith("_") and name.isupper() and not isinstance(value, str)}  # a group, or groups by key
    backend = comm.cdb
    modules = [importlib.import_module(f"deepspeed.runtime.zero.{name}")
               for name in ("utils", "partition_parameters", "partitioned_param_coordinator")]
    vars(groups).update({name: {} if isinstance(value, dict) else None for name, value in caches.items()})
    comm.cdb = None
    try:
        with contextlib.ExitStack() as patches:
            for module in modules:
                patches.enter_context(mock.patch.object(module, "assert_ints_same_as_other_ranks", lambda ints: None))
            yield
    finally:
        vars(groups).update(caches)
        comm.cdb = backend


@contextmanager
def after_each_gather(callback: Callable[[torch.nn.Module], None]) -> Iterator[None]:
    """Within: `callback(module)` once ZeRO-3 has gathered a module's parameters for its forward or backward."""
    from unittest import mock

    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as coordinator

    fetch = coordinator.fetch_sub_module

    def fetch_then_call(self: Any, current_submodule: torch.nn.Module, forward: bool) -> None:
        fetch(self, current_submodule, forward)
        callback(current_submodule)

    with mock.patch.object(coordinator, "fetch_sub_module", fetch_then_call):
        yield


@contextmanager
def after_bucket_setup(callback: Callable[[list[torch.Tensor]], None]) -> Iterator[None]:
    """Within: `callback(buffers)` once ZeRO-1/2 have made the gradient buckets a backward fills (`ipg_buckets`:
    one per gradient dtype, two buffers each with overlap_comm)."""
    from unittest import mock

    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    setup = DeepSpeedZeroOptimizer.setup_buckets

    def setup_then_call(self: Any) -> None:
        setup(self)
        callback([buffer for bucket in self.ipg_buckets.values() for buffer in bucket.buffer])

    with mock.patch.object(DeepSpeedZeroOptimizer, "setup_buckets", setup_then_call):
        yield


def zero3_partitions(module: torch.nn.Module) -> list[torch.Tensor]:
    """Each parameter's ZeRO-3 partition: the part this rank keeps between uses (`ds_tensor`)."""
    return [param.ds_tensor for param in module.parameters() if getattr(param, "ds_tensor", None) is not None]


def zero3_persistent(module: torch.nn.Module, recurse: bool = True) -> list[torch.nn.Parameter]:
    """The parameters ZeRO-3 keeps whole on every rank (smaller than its persistence threshold)."""
    return [param for param in module.parameters(recurse=recurse) if getattr(param, "ds_persist", False)]


def zero3_whole_shape(param: torch.nn.Parameter) -> tuple[tuple[int, ...], tuple[int, ...], bool] | None:
    """(the whole shape, this rank's partition's shape, whether ZeRO-3 keeps it whole) of a ZeRO-3 parameter; None
    for any other."""
    if getattr(param, "ds_tensor", None) is None:
        return None
    return tuple(param.ds_shape), tuple(param.ds_tensor.shape), bool(getattr(param, "ds_persist", False))


def zero3_gradient_partitions(optimizer: Any) -> list[torch.Tensor]:
    """ZeRO-3's gradient partitions, which it keeps from step to step (one flat buffer, when contiguous); none
    below stage 3."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    if not isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        return []
    return [t for t in getattr(optimizer, _ZERO3_GRADIENT_PARTITIONS).values() if t is not None]


@contextmanager
def autoep_reads_transformers_outputs() -> Iterator[None]:
    """While inside, transformers' registry of the outputs a model records answers `get(key, default)` as the dict
    it is. DeepSpeed 0.19.8's AutoEP, when it swaps a MoE block, re-points the router-logits recorder (the
    load-balancing loss reads it) by saving and restoring registry entries with `registry.get(key, default)`;
    transformers 5 gave the registry a `get(model)` of its own, so the swap failed on every MoE model ("TypeError:
    _CanRecordRegistry.get() takes 2 positional arguments but 3 were given"). A key given as a string, or a default,
    is the dict's lookup; a model is transformers' own. Checked on DeepSpeed 0.19.8 with transformers 5.25."""
    from transformers.utils import output_capturing

    registry = type(output_capturing._CAN_RECORD_REGISTRY)
    own_get = registry.get

    def get(self: dict, key: Any, *default: Any) -> Any:
        return dict.get(self, key, *default) if default or isinstance(key, str) else own_get(self, key)

    registry.get = get
    try:
        yield
    finally:
        registry.get = own_get


def zero_gradient(param: torch.nn.Parameter, engine: Any) -> tuple[torch.Tensor, Any] | None:
    """`param`'s gradient as DeepSpeed holds it between backward and the engine's step, unscaled, and the process
    group holding its other parts: this rank's partition under ZeRO-3 (its partition group), the whole gradient under
    ZeRO-1/2 (DeepSpeed's `safe_get_full_grad` all-reduces its fragments; None); None where it holds none."""
    from deepspeed.utils import safe_get_full_grad, safe_get_local_grad  # here: importing DeepSpeed takes seconds

    if hasattr(param, "ds_id"):
        grad, group = safe_get_local_grad(param), param.ds_process_group
    else:
        grad, group = safe_get_full_grad(param), None
    if grad is None:
        return None
    scale = getattr(engine.optimizer, "loss_scale", 1.0)  # fp16's scaled gradients, unscaled only in the step
    return (grad if scale == 1 else grad / scale), group


def engine_saves(engine: Any) -> bool:
    """Whether `engine` can write a checkpoint: the engine Lightning builds to evaluate under ZeRO-3 (after
    `trainer.test`, `validate` or `predict`) has no checkpoint engine, and its `save_checkpoint` stops on rank 0
    alone (`'NoneType' object has no attribute 'makedirs'`) while the other ranks wait in its barrier."""
    return getattr(engine, "checkpoint_engine", None) is not None
