"""DeepSpeed checkpoints at another world size: converted to DeepSpeed's universal format, which its engine
re-partitions (weights and Adam state, per parameter) for any number of ranks.

The conversion (`deepspeed.checkpoint.ds_to_universal`) runs once, on demand, and lives inside the checkpoint
directory beside the tag it was made from (`<tag>_universal` and `latest_universal`): nothing saved is changed.

    python -m lightning_dist.checkpoints.universal CHECKPOINT_DIR     # ahead of time, e.g. on a login node
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from lightning_dist.checkpoints.formats import DEEPSPEED, CheckpointError, checkpoint_format, deepspeed_tag_dir
from lightning_dist.checkpoints.safe_load import load_file

LATEST_UNIVERSAL = "latest_universal"  # written last by ds_to_universal: its presence means a finished conversion


def saved_world_size(path: str | Path) -> int | None:
    """The number of data-parallel ranks that wrote the DeepSpeed checkpoint at `path` (None if it does not say)."""
    model_states = sorted(deepspeed_tag_dir(Path(path)).glob("*model_states.pt"))
    return load_file(model_states[0], mmap=True).get("dp_world_size")


def ensure_universal(path: str | Path) -> Path:
    """The universal form of the DeepSpeed checkpoint at `path`, made now unless an earlier conversion finished."""
    path = Path(path)
    if checkpoint_format(path) != DEEPSPEED:
        raise CheckpointError(f"ckpt_path: {path} is not a DeepSpeed checkpoint directory; only those convert to universal")
    tag_dir = deepspeed_tag_dir(path)
    output = tag_dir.with_name(f"{tag_dir.name}_universal")
    if (path / LATEST_UNIVERSAL).is_file() and (path / LATEST_UNIVERSAL).read_text().strip() == output.name:
        return output
    if output.exists():
        shutil.rmtree(output)  # a conversion that was cut off
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal, parse_arguments

    # Our models carry no Megatron-style `universal_checkpoint_info`: DeepSpeed injects the plain default.
    argv = ["--input_folder", str(tag_dir), "--output_folder", str(output), "--inject_missing_state", "--num_extract_workers", "1"]
    saved_argv, sys.argv = sys.argv, [sys.argv[0], *argv]
    try:
        ds_to_universal(parse_arguments())
    finally:
        sys.argv = saved_argv
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Convert a DeepSpeed checkpoint to DeepSpeed's universal format, in place.")
    parser.add_argument("checkpoint", type=Path, help="a DeepSpeed checkpoint directory (with a 'latest' file)")
    args = parser.parse_args(argv)
    try:
        output = ensure_universal(args.checkpoint)
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"Universal checkpoint: {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
