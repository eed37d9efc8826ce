"""Turn any strategy's checkpoint into one plain file that loads in a plain process: no process group, no DeepSpeed.

    python -m lightning_dist.checkpoints.consolidate CHECKPOINT OUTPUT.ckpt

The file is a regular Lightning checkpoint: `Model.load_from_checkpoint(OUTPUT)` and
`model.load_state_dict(torch.load(OUTPUT)["state_dict"], strict=True)` read it, and training can resume from it
under DDP or FSDP at any world size. Sharded Adam state (ZeRO partitions, FSDP shards) is gathered per parameter
name into `optimizer_state_by_name`, which those strategies load into whatever optimizer layout they build.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import torch

from lightning_dist._compat.deepspeed import merge_zero_partitions
from lightning_dist._compat.lightning import WRAPPED_MODULE_PREFIX
from lightning_dist.checkpoints.autoep_names import AUTOEP_NAMES, model_named_state
from lightning_dist.checkpoints.contents import autotp_refusal, autotp_size, saved_by_autoep
from lightning_dist.checkpoints.formats import (
    AVERAGE_STATE_DICT,
    CURRENT_MODEL_STATE,
    DEEPSPEED,
    FILE,
    CheckpointError,
    command_exit,
    deepspeed_tag_dir,
)
from lightning_dist.checkpoints.frozen_weights import LEFT_OUT, check_left_out
from lightning_dist.checkpoints.safe_load import load_file
from lightning_dist.checkpoints.save_id import SAVE_ID
from lightning_dist.checkpoints.source import CheckpointSource

# A consolidated checkpoint's record of the saved optimizer's parameter groups, each without its parameters: the
# hyper-parameters (learning rate, betas, weight decay) as the run's schedule had last set them.
GROUP_SETTINGS = "optimizer_group_settings"


def load_consolidated(path: str | Path | CheckpointSource, trusted: bool = False) -> dict[str, Any]:
    """The checkpoint at `path` as one in-memory Lightning checkpoint dict with a full fp32 `state_dict`.
    Unless `trusted` (or vetted already, for a CheckpointSource), a checkpoint whose pickles hold anything but data
    is refused (UnsafeCheckpointError)."""
    source = CheckpointSource.of(path, trusted)
    if source.format == FILE:
        return load_file(source.path, trusted=source.readable)  # the safe unpickler vets as it loads
    source = source.vet()  # DeepSpeed's and DCP's readers below unpickle freely
    if source.format == DEEPSPEED:
        return _load_deepspeed(source.path)
    return _load_distributed(source.path)


def load_from_checkpoint(module_class: type[Any], path: str | Path, trusted: bool = False, **kwargs: Any) -> Any:
    """`module_class.load_from_checkpoint` for any checkpoint our strategies write: a file, or a DeepSpeed or FSDP
    directory (consolidated in memory first, as `consolidate_checkpoint` would write it). `kwargs` go to Lightning's
    `load_from_checkpoint` (`map_location`, `strict`, hyper-parameter overrides)."""
    checkpoint = load_consolidated(path, trusted)
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    if LEFT_OUT not in checkpoint:
        return module_class.load_from_checkpoint(buffer, **kwargs)
    # The frozen weights come from the module as it builds itself (its __init__ and configure_model): checked.
    with warnings.catch_warnings():  # Lightning's list of them, every frozen name: checked below instead
        warnings.filterwarnings("ignore", message="Found keys that are in the model state dict but not in the")
        module = module_class.load_from_checkpoint(buffer, **{**kwargs, "strict": False})
    check_left_out(module, checkpoint[LEFT_OUT])
    unsaved = sorted(set(module.state_dict()) - set(checkpoint["state_dict"]) - set(checkpoint[LEFT_OUT]))
    if unsaved and kwargs.get("strict", module.strict_loading) is not False:
        raise CheckpointError(f"checkpoint: {path} has no weights for {', '.join(unsaved[:3])} (of {len(unsaved)})")
    return module


def consolidate_checkpoint(path: str | Path, output: str | Path, trusted: bool = False) -> Path:
    """Write `path`'s checkpoint as a single plain file at `output` (which must not exist yet)."""
    output = Path(output)
    if output.exists():
        raise CheckpointError(f"output: {output} exists; consolidation never overwrites a file, choose a new path")
    check_memory_for(path)
    checkpoint = load_consolidated(path, trusted)
    output.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, output)
    return output


def memory_needed(path: str | Path) -> int:
    """About how many bytes consolidating `path` holds at once: every tensor it saved, weights and optimizer state,
    is in memory together (rank files are read whole, and the merged copy is built beside them)."""
    path = Path(path)
    saved = path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return 2 * saved


def check_memory_for(path: str | Path) -> None:
    """Refuse up front, naming the figures, a consolidation that this machine's memory cannot hold."""
    needed, available = memory_needed(path), _available_memory()
    if available is not None and needed > available:
        raise CheckpointError(
            f"checkpoint: consolidating {path} needs about {needed / 1e9:.1f} GB of memory and {available / 1e9:.1f} GB"
            " is available; run it on a machine with more memory, or resume the checkpoint directly (each strategy"
            " reads it on rank 0 only)"
        )


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def _load_deepspeed(path: Path) -> dict[str, Any]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint, get_model_state_files

    tag_dir = deepspeed_tag_dir(path)
    if (size := autotp_size(path)) > 1:  # each file holds one tensor-parallel rank's part of the split layers
        raise CheckpointError(autotp_refusal(path, size, "checkpoint"))
    # Lightning keeps its own state (loops, callbacks, hyper-parameters) in rank 0's model-states file.
    client_state = load_file(get_model_state_files(str(tag_dir))[0], trusted=True)  # vetted above
    if saved_by_autoep(path, "checkpoint"):  # AutoEP's layers, back in the model's names
        state_dict, state_by_name = model_named_state(tag_dir, client_state, path)
        return _lightning_checkpoint(client_state, state_dict, state_by_name, client_state[AUTOEP_NAMES])
    # DeepSpeed's reader prints its progress (each merge three times over); a failure raises, with its own message.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        state_dict = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=tag_dir.name)
        state_by_name, param_groups = _deepspeed_adam_state(tag_dir)
    return _lightning_checkpoint(client_state, state_dict, state_by_name, param_groups=param_groups)


def _lightning_checkpoint(
    client_state: dict[str, Any], state_dict: dict[str, torch.Tensor], state_by_name: dict[str, dict],
    autoep_blocks: dict[str, Any] | None = None, param_groups: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Lightning's checkpoint from rank 0's DeepSpeed client state and the weights and Adam state gathered apart."""
    deepspeed_keys = {"module", "optimizer", "lr_scheduler", "csr_tensor_module_names", "skipped_steps",
                      "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
                      "buffer_names", "param_shapes", "frozen_param_shapes", "shared_params", "frozen_param_fragments",
                      "sparse_tensor_module_names", "data_sampler", "random_ltd", "checkpoint_parallel_dimensions",
                      "num_experts", "ds_autoep_layers", "universal_checkpoint_info", AUTOEP_NAMES}
    # zero_to_fp32 rebuilds trainable weights from the optimizer's fp32 partitions and, for ZeRO-1, silently
    # drops frozen ones; those never change, so the module's own (unpartitioned below ZeRO-3) copy is exact.
    # (AutoEP's layers hold their own names and, below ZeRO-3, each rank's share of the experts: not the model's.)
    autoep_layers = tuple(f"{block}." for block in autoep_blocks or {})
    for name, tensor in client_state.get("module", {}).items():
        if name not in state_dict and tensor.numel() > 0 and not name.startswith(autoep_layers):
            state_dict[name] = tensor.float() if tensor.is_floating_point() else tensor
    checkpoint = {k: v for k, v in client_state.items() if k not in deepspeed_keys}
    checkpoint["state_dict"] = {k.removeprefix(WRAPPED_MODULE_PREFIX): v for k, v in state_dict.items()}
    if AVERAGE_STATE_DICT in checkpoint:  # a weight average in Lightning's layout: `state_dict` is the average
        checkpoint[CURRENT_MODEL_STATE] = checkpoint["state_dict"]
        checkpoint["state_dict"] = checkpoint.pop(AVERAGE_STATE_DICT)
    return _with_state_by_name(checkpoint, {k.removeprefix(WRAPPED_MODULE_PREFIX): v for k, v in state_by_name.items()},
                               param_groups)


def _deepspeed_adam_state(ds_dir: Path) -> tuple[dict[str, dict[str, torch.Tensor]], list[dict[str, Any]]]:
    """Adam's moments per parameter name, un-partitioned with DeepSpeed's own merge of the fp32 master weights:
    the base optimizer's moments have exactly the flat layout of those weights. And its parameter groups."""
    import deepspeed.utils.zero_to_fp32 as z

    model_states = z.parse_model_states(z.get_model_state_files(str(ds_dir)))
    shards = [load_file(f, trusted=True)["optimizer_state_dict"]  # vetted by load_consolidated
              for f in z.get_optim_files(str(ds_dir))]
    stage, world_size = shards[0]["zero_stage"], len(shards)
    base = [shard["base_optimizer_state" if stage <= 2 else "optimizer_state_dict"] for shard in shards]
    states, param_groups = [optimizer["state"] for optimizer in base], base[0]["param_groups"]
    if not states[0] or not all("exp_avg" in group for group in states[0].values()):
        return {}, param_groups  # not an Adam-family optimizer (SGD keeps none): no moments we know how to map
    trainable = [name for group in model_states[0].param_shapes for name in group]
    moments = {}
    for key in ("exp_avg", "exp_avg_sq"):
        flat = [[state[group][key] for group in sorted(state)] for state in states]
        merged = merge_zero_partitions(stage, world_size, flat, model_states, shards[0].get("param_alignment_paddings"))
        moments[key] = z.to_torch_tensor(merged)  # ZeRO-3 merges lazily; materialise
    step = next(iter(states[0].values()))["step"]
    return {
        name.removeprefix(WRAPPED_MODULE_PREFIX): {
            # Host data, like the rest of a loaded checkpoint.
            "step": torch.as_tensor(step, dtype=torch.float32, device="cpu").clone(),
            "exp_avg": moments["exp_avg"][name],
            "exp_avg_sq": moments["exp_avg_sq"][name],
        }
        for name in trainable
    }, param_groups


def _load_distributed(path: Path) -> dict[str, Any]:
    from lightning_dist._compat.lightning import load_distributed_checkpoint

    checkpoint = load_distributed_checkpoint(path)
    checkpoint.pop(SAVE_ID, None)  # which save the shards are of: checked (whole.py), nothing to restore
    optimizer_keys = sorted(k for k in checkpoint if k.startswith("optimizer_"))
    # DCP stores optimizer state keyed by parameter name already (one optimizer: the case we can map).
    saved = checkpoint[optimizer_keys[0]] if len(optimizer_keys) == 1 else {}
    for key in optimizer_keys:
        del checkpoint[key]
    return _with_state_by_name(checkpoint, saved.get("state", {}), saved.get("param_groups"))


def _with_state_by_name(checkpoint: dict[str, Any], state_by_name: dict[str, dict],
                        param_groups: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    # An empty list rather than a missing key: Lightning then restores loops, weights and learning-rate schedules
    # (as saved: a schedule restarted from its first step warmed up again) and leaves the optimizer to the strategy,
    # which reads `optimizer_state_by_name`, and each group's hyper-parameters from `GROUP_SETTINGS`.
    checkpoint["optimizer_states"] = []
    checkpoint.setdefault("lr_schedulers", [])
    checkpoint["optimizer_state_by_name"] = state_by_name
    if param_groups is not None:
        checkpoint[GROUP_SETTINGS] = [{k: v for k, v in group.items() if k != "params"} for group in param_groups]
    return checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Consolidate a DDP, FSDP or DeepSpeed checkpoint into one file.")
    parser.add_argument("checkpoint", type=Path, help="a .ckpt file, or a DeepSpeed or FSDP checkpoint directory")
    parser.add_argument("output", type=Path, help="the single file to write (must not exist)")
    parser.add_argument("--trust-checkpoint", action="store_true",
                        help="load pickled objects other than tensors and plain data (runs code the file names)")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # consolidation runs on the host; DeepSpeed need not look for one
    make = partial(consolidate_checkpoint, args.checkpoint, args.output, trusted=args.trust_checkpoint)
    return command_exit(make, f"Consolidated {args.checkpoint} -> ")


if __name__ == "__main__":
    sys.exit(main())
