"""Whether a finished checkpoint is whole: every file it needs is there and unchanged since its save. This is what
`resume=true` looks for (passing over a damaged newer checkpoint for an older whole one) and what `ckpt_path` must be.

Our saves record a manifest (manifest.py); a `.ckpt` file carries its zip's CRCs. A directory saved without a
manifest, by Lightning's or DeepSpeed's own strategies, is held to the files its format names: every file DCP's
`.metadata` points into, at least as long as the bytes it points at, and one of each per-rank DeepSpeed file for the
world size the save recorded, each of the step its model states record; and a sharded save of ours, each file to
the save its metadata file records (save_id.py).
"""

from __future__ import annotations

from pathlib import Path

from lightning_dist.checkpoints.formats import (
    LIGHTNING_METADATA,
    CheckpointError,
    check_complete,
    deepspeed_tag_dir,
    is_complete,
    is_deepspeed_dir,
    is_distributed_dir,
    unreadable,
)
from lightning_dist.checkpoints.manifest import has_manifest, manifest_problem, zip_problem
from lightning_dist.checkpoints.safe_load import load_file
from lightning_dist.checkpoints.save_id import mixed_save_problem
from lightning_dist.checkpoints.source import CheckpointSource


def first_problem(path: str | Path, trusted: bool = False) -> str | None:
    """What makes the finished checkpoint at `path` not whole, naming the file, or None. `trusted`: as for
    `ckpt_path`, whether its pickles may hold more than data (the DeepSpeed world size is read from one)."""
    path = Path(path)
    if path.is_file():
        return zip_problem(path)
    if has_manifest(path):
        return manifest_problem(path)
    if is_deepspeed_dir(path):
        return _deepspeed_problem(deepspeed_tag_dir(path), trusted)
    if is_distributed_dir(path):
        return _distributed_problem(path, trusted)
    return None


def is_whole(path: str | Path) -> bool:
    """Whether a checkpoint's save finished and nothing of it changed since."""
    return is_complete(path) and first_problem(path) is None


def check_whole(path: str | Path | CheckpointSource, key: str = "ckpt_path", trusted: bool = False) -> None:
    """CheckpointError, one line naming the file, unless `path` is a finished checkpoint that is whole."""
    source = CheckpointSource.of(path, trusted, key)
    if problem := unreadable(source.path):
        raise CheckpointError(f"{key}: {path}: {problem}; pass a checkpoint this run can read")
    check_complete(source.path, key, source.format)
    if problem := first_problem(source.path, source.trusted):
        raise CheckpointError(
            f"{key}: {path} is damaged: {problem}; pass another checkpoint, or resume=true to continue"
            " from the newest whole one"
        )


def _deepspeed_problem(tag_dir: Path, trusted: bool) -> str | None:
    from lightning_dist._compat.deepspeed import missing_rank_files

    model_states = load_file(sorted(tag_dir.glob("*model_states.pt"))[0], mmap=True, trusted=trusted)
    missing = missing_rank_files(tag_dir, model_states)
    if missing:
        return f"{missing[0]} is missing (the save had {model_states.get('dp_world_size')} ranks)"
    return _other_save_problem(tag_dir, model_states, trusted)


def _other_save_problem(tag_dir: Path, model_states: dict, trusted: bool) -> str | None:
    """Which per-rank file is of another save than the model states that name the world size: a rank's file of
    another step has the same shape and size, and DeepSpeed would restore it without a word. Each file is read as
    its pickle only (its tensors memory-mapped, never loaded).

    ZeRO-3's per-rank model states record the engine's step. An optimizer counts its own steps, from where the
    optimizer state it was given left off: after a resume from another strategy's checkpoint it is ahead of the
    engine's count by as many steps on every rank. So optimizer files agree with one another, and with the engine's
    count where one of them does."""
    from lightning_dist._compat.deepspeed import saved_steps

    step = int(model_states.get("global_steps") or 0)
    files = {file: saved_steps(load_file(file, mmap=True, trusted=trusted))
             for file in sorted(tag_dir.glob("*zero_pp_rank_*.pt"))}
    optimizer_files = {file: steps for file, steps in files.items() if "optim_states" in file.name and steps}
    counts = {count for steps in optimizer_files.values() for count in steps}
    engine_count = step - int(model_states.get("skipped_steps") or 0)  # fp16 overflows: steps the optimizer skipped
    first_count = min(next(iter(optimizer_files.values()), {engine_count}))
    reference = engine_count if engine_count in counts else first_count
    for file, steps in files.items():
        offset = step - reference if file in optimizer_files else 0
        if not (others := sorted(found + offset for found in steps if found + offset != step)):
            continue
        if offset:  # counted from another checkpoint's optimizer state: no step of this run to name
            return (
                f"{file} is of another save: its optimizer has taken {others[0] - offset} steps, the other ranks' "
                f"{reference}"
            )
        return f"{file} is of the save at step {others[0]}; the rest of the checkpoint is of the save at step {step}"
    return None


def _distributed_problem(directory: Path, trusted: bool) -> str | None:
    from lightning_dist._compat.torch import saved_file_extents

    for name, extent in sorted(saved_file_extents(str(directory)).items()):
        file = directory / name
        if not file.is_file():
            return f"{file} is missing (its .metadata names it)"
        if file.stat().st_size < extent:
            return f"{file} has {file.stat().st_size} bytes, its .metadata points at byte {extent}"
    if (directory / LIGHTNING_METADATA).is_file():  # every shard of the one save it records (save_id.py)
        return mixed_save_problem(directory, load_file(directory / LIGHTNING_METADATA, trusted=trusted))
    return None
