"""What a checkpoint holds, read without loading its tensors: its model's weights by name and shape, and whether
they are this model's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_dist._compat.lightning import WRAPPED_MODULE_PREFIX
from lightning_dist.checkpoints.autoep_names import AUTOEP_NAMES
from lightning_dist.checkpoints.formats import (
    DEEPSPEED,
    DISTRIBUTED,
    FILE,
    LIGHTNING_METADATA,
    CheckpointError,
    deepspeed_tag_dir,
)
from lightning_dist.checkpoints.frozen_weights import LEFT_OUT
from lightning_dist.checkpoints.safe_load import load_file
from lightning_dist.checkpoints.source import CheckpointSource

# Lightning's DeepSpeed strategy handed DeepSpeed the module inside a wrapper, and DeepSpeed named parameters by it.
_WRAPPER_PREFIX = WRAPPED_MODULE_PREFIX

Shape = tuple[int, ...]


def state_dict_shapes(
    path: str | Path | CheckpointSource, key: str = "ckpt_path", trusted: bool = False
) -> dict[str, Shape | None]:
    """The model's weights a checkpoint holds, name -> shape (None where the checkpoint does not record it), read
    from metadata or memory-mapped files: no tensor is loaded."""
    source = CheckpointSource.of(path, trusted, key)
    path, kind, trusted = source.path, source.format, source.trusted
    if kind == FILE:
        checkpoint = load_file(path, key, mmap=True, trusted=trusted)
        if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
            found = (
                ", ".join(map(str, list(checkpoint)[:5])) if isinstance(checkpoint, dict) else type(checkpoint).__name__
            )
            raise CheckpointError(
                f"{key}: {path} is not a Lightning checkpoint: it holds no state_dict (it holds: {found or 'nothing'});"
                " ckpt_path resumes from a checkpoint a Lightning run saved"
            )
        return {**{name: _shape(tensor) for name, tensor in checkpoint["state_dict"].items()},
                **_left_out_shapes(checkpoint)}
    if kind == DISTRIBUTED:
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        lightning = load_file(path / LIGHTNING_METADATA, key, trusted=trusted)
        return {**{name.removeprefix("state_dict."): tuple(getattr(entry, "size", ())) or None
                   for name, entry in metadata.items() if name.startswith("state_dict.")},
                **_left_out_shapes(lightning if isinstance(lightning, dict) else {})}
    model_states = load_file(
        sorted(deepspeed_tag_dir(path).glob("*model_states.pt"))[0], key, mmap=True, trusted=trusted
    )
    # ZeRO-3 saves each parameter as an empty placeholder and records its whole shape beside it.
    groups = [*(model_states.get("param_shapes") or []), model_states.get("frozen_param_shapes") or {}]
    recorded: dict[str, tuple[int, ...] | None] = {
        name.removeprefix(_WRAPPER_PREFIX): tuple(shape) for group in groups for name, shape in group.items()
    }
    for name, source in (model_states.get("shared_params") or {}).items():  # tied weights: one shape recorded
        recorded.setdefault(name.removeprefix(_WRAPPER_PREFIX), recorded.get(source.removeprefix(_WRAPPER_PREFIX)))
    recorded.update(autotp_logical_shapes(model_states))
    module = {name.removeprefix(_WRAPPER_PREFIX): tensor for name, tensor in model_states["module"].items()}
    return {**{name: recorded.get(name) or _shape(tensor) for name, tensor in module.items()},
            **_left_out_shapes(model_states)}


def _left_out_shapes(saved: dict[str, Any]) -> dict[str, Shape | None]:
    """The frozen weights a checkpoint left out (frozen_weights.py): a resume takes them from the model it builds."""
    return {name: tuple(entry["shape"]) for name, entry in (saved.get(LEFT_OUT) or {}).items()}


def left_frozen_weights_out(path: str | Path | CheckpointSource) -> bool:
    """Whether a sharded checkpoint (FSDP's or DeepSpeed's directory) left its frozen weights out (frozen_weights.py):
    read from its metadata, no tensor loaded. Such a checkpoint loads like another engine's, around those weights."""
    source = CheckpointSource.of(path)
    if source.format == FILE:
        return False  # a file is read whole by every loader, which takes LEFT_OUT from it
    record = _lightning_record(source)
    return isinstance(record, dict) and LEFT_OUT in record


def saved_weights_only(path: str | Path | CheckpointSource) -> bool:
    """Whether a Lightning checkpoint was saved with `ModelCheckpoint(save_weights_only=True)` (or
    `trainer.save_checkpoint(weights_only=True)`): Lightning then leaves out the callbacks' and the schedulers' state
    with the optimizer's, which it saves otherwise, empty where there are none. Read without loading a tensor."""
    record = _lightning_record(CheckpointSource.of(path))
    return (isinstance(record, dict) and "pytorch-lightning_version" in record  # not another library's DeepSpeed save
            and "callbacks" not in record and "lr_schedulers" not in record)


def weights_only_refusal(path: str | Path, test_it: str) -> str:
    """The line that refuses to train on from a checkpoint `saved_weights_only`; `test_it`: how the user tests it."""
    return (f"ckpt_path: {path} holds the model's weights only (saved with save_weights_only=True): no optimizer state"
            f" to train on from; test it with {test_it}, or save whole checkpoints to resume")


def _lightning_record(source: CheckpointSource) -> Any:
    """What Lightning saved beside the tensors: a file's dict (memory-mapped), an FSDP directory's metadata, the client
    state in DeepSpeed's first model-states file."""
    if source.format == DISTRIBUTED:
        return load_file(source.path / LIGHTNING_METADATA, trusted=source.readable)
    if source.format == DEEPSPEED:
        return load_file(sorted(deepspeed_tag_dir(source.path).glob("*model_states.pt"))[0], mmap=True,
                         trusted=source.readable)
    return load_file(source.path, mmap=True, trusted=source.readable)


def saved_step(path: str | Path | CheckpointSource) -> int | None:
    """The global step a Lightning checkpoint was saved at (from its loops' record, no tensor loaded), or None."""
    source = CheckpointSource.of(path)
    if source.format == FILE:
        record = load_file(source.path, mmap=True)
    elif source.format == DISTRIBUTED:
        record = load_file(source.path / LIGHTNING_METADATA)
    else:  # Lightning's client state, beside the engine's own count
        record = load_file(sorted(deepspeed_tag_dir(source.path).glob("*model_states.pt"))[0], mmap=True)
    step = record.get("global_step", record.get("global_steps")) if isinstance(record, dict) else None
    return None if step is None else int(step)


def autotp_logical_shapes(model_states: dict[str, Any]) -> dict[str, Shape]:
    """DeepSpeed AutoTP saves each tensor-parallel rank's part of a split layer, and records the whole layer's
    shape in its universal-checkpoint map (one `^name$` pattern per parameter)."""
    info = model_states.get("universal_checkpoint_info") or {}
    params = (info.get("affine_map") or {}).get("params") or {}
    return {pattern.strip("^$").replace("\\.", ".").removeprefix(_WRAPPER_PREFIX): tuple(entry["logical_shape"])
            for pattern, entry in params.items()}


def autotp_size(path: str | Path) -> int:
    """The tensor-parallel size a DeepSpeed checkpoint directory was saved with (1: none)."""
    return max(1, len(list(deepspeed_tag_dir(Path(path)).glob("mp_rank_*_model_states.pt"))))


def _shape(tensor: Any) -> Shape | None:
    shape = getattr(tensor, "shape", None)
    return tuple(shape) if shape is not None and tensor.numel() > 0 else None


def check_checkpoint_matches(
    path: str | Path | CheckpointSource, expected: dict[str, Shape], key: str = "ckpt_path", trusted: bool = False
) -> None:
    """CheckpointError when the checkpoint is of another model: its weights' names or shapes differ from the
    model's (`expected`, name -> shape, which a model built on the meta device gives without memory)."""
    if (difference := another_model(path, expected, key, trusted)) is not None:
        raise CheckpointError(f"{key}: {path} {difference}; build the model as the run that saved it did (its"
                              " .hydra/config.yaml)")


def another_model(
    path: str | Path | CheckpointSource, expected: dict[str, Shape], key: str = "ckpt_path", trusted: bool = False
) -> str | None:
    """How the checkpoint's weights differ from the model's (`expected`), or None where they are this model's."""
    found = state_dict_shapes(path, key, trusted)
    missing, unexpected = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    if missing or unexpected:
        return (f"holds another model's weights: {len(missing)} of this model's keys are missing"
                f" (e.g. {', '.join(missing[:3]) or '-'}) and {len(unexpected)} are not in this model"
                f" (e.g. {', '.join(unexpected[:3]) or '-'})")
    reshaped = [
        name for name in expected if found[name] is not None and tuple(found[name] or ()) != tuple(expected[name] or ())
    ]
    if reshaped:
        first = reshaped[0]
        return (f"holds another model's weights: {len(reshaped)} have other shapes (e.g. {first} is"
                f" {list(found[first] or ())} there and {list(expected[first] or ())} in this model)")
    return None


def check_autotp_layout(
    path: str | Path | CheckpointSource, autotp_target: int | None, key: str = "ckpt_path"
) -> None:
    """CheckpointError unless a DeepSpeed AutoTP checkpoint resumes where DeepSpeed reads it as it is: a DeepSpeed
    strategy (`autotp_target`, its tensor-parallel size; None for any other strategy) of the same size."""
    source = CheckpointSource.of(path, key=key)
    path = source.path
    if source.format != DEEPSPEED or (size := autotp_size(path)) == 1 or autotp_target == size:
        return
    raise CheckpointError(autotp_refusal(path, size, key))


def autotp_refusal(path: Path, size: int, key: str = "ckpt_path") -> str:
    return (
        f"{key}: {path} is a DeepSpeed AutoTP checkpoint (tensor-parallel size {size}): it resumes under a DeepSpeed"
        f" strategy with strategy.tensor_parallel_size={size}; moving it to another layout or one file is not"
        " supported yet"
    )


# DeepSpeed's AutoEP names a mixture-of-experts layer's router its own way (strategies/deepspeed/autoep.py); its
# experts go to files of their own.
_AUTOEP_NAMES = (".router.gate.weight", ".gate.gate.weight")  # its router, kept under both names


def saved_by_autoep(path: str | Path | CheckpointSource, key: str = "ckpt_path", trusted: bool = False) -> bool:
    """Whether the checkpoint holds layers DeepSpeed's AutoEP swapped in (their names, not the model's)."""
    names = state_dict_shapes(path, key, trusted)
    return all(any(name.endswith(suffix) for name in names) for suffix in _AUTOEP_NAMES)


def check_autoep_layout(path: str | Path | CheckpointSource, autoep_size: int | None, key: str = "ckpt_path") -> bool:
    """Whether the checkpoint was saved under DeepSpeed's AutoEP (its layer names, not the model's, checked against
    the model after loading rather than before). `autoep_size`: the run's AutoEP size under a DeepSpeed strategy (1:
    none), None under another. DeepSpeed reads an AutoEP checkpoint of its own size as it is; every other run reads
    it in the model's names (checkpoints/autoep_names.py), for which the run that saved it must have recorded them:
    CheckpointError in one line where it did not."""
    source = path if isinstance(path, CheckpointSource) else CheckpointSource.of(path, key=key)
    if not saved_by_autoep(source, key, source.trusted):
        return False
    saved = load_file(sorted(deepspeed_tag_dir(source.path).glob("*model_states.pt"))[0], key, mmap=True,
                      trusted=source.trusted)
    saved_size = int(((saved.get("ds_config") or {}).get("expert_parallel") or {}).get("autoep_size", 1))
    if autoep_size != saved_size and not saved.get(AUTOEP_NAMES):
        raise CheckpointError(f"{key}: {source.path} was saved under DeepSpeed's expert parallelism (AutoEP) by a"
                              " lightning-dist that did not record the model's names of its layers; it resumes only"
                              f" under a DeepSpeed strategy with strategy.expert_parallel_size={saved_size}")
    return True
