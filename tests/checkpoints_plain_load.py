"""Load consolidated checkpoints the way a user would after training: a fresh process, no process group, no
DeepSpeed. Compares each with the weights gathered at the end of its training run.

    python -m tests.checkpoints_plain_load CONSOLIDATED GATHERED [CONSOLIDATED GATHERED ...]

Prints `CONSOLIDATED: OK`, or the assertion that failed, for each pair (one process for all: its start-up is the
cost); exits 1 if any failed."""

import sys
import traceback

# As on a machine without DeepSpeed: an import of it fails. Asking afterwards whether it had been imported is not
# enough: on the H200 (2026-12-04) a library imported the DeepSpeed it found installed, though the load needs none.
sys.modules["deepspeed"] = None  # type: ignore[assignment]

import torch  # noqa: E402

from tests.models.checkpoint_probe import CheckpointProbeGPT  # noqa: E402


def check(consolidated_path: str, gathered_path: str) -> None:
    gathered = torch.load(gathered_path, map_location="cpu")
    model = CheckpointProbeGPT.load_from_checkpoint(consolidated_path, map_location="cpu")  # strict
    state_dict = torch.load(consolidated_path, map_location="cpu", weights_only=True)["state_dict"]
    fresh = CheckpointProbeGPT(**model.hparams)
    incompatible = fresh.load_state_dict(state_dict, strict=True)
    assert not incompatible.missing_keys and not incompatible.unexpected_keys, incompatible

    loaded = model.state_dict()
    assert loaded.keys() == gathered.keys(), sorted(loaded.keys() ^ gathered.keys())
    for name, tensor in gathered.items():
        assert loaded[name].shape == tensor.shape, (name, loaded[name].shape, tensor.shape)
        assert torch.equal(loaded[name], tensor), (name, (loaded[name] - tensor).abs().max())
    assert model.model.lm_head.weight is model.model.token_embedding.weight, "the head no longer shares the embedding"
    assert model.bytes_seen.sum() > 0, "the buffer bytes_seen is all zeros: re-initialised, not loaded"
    assert not torch.distributed.is_initialized(), "loading started a process group"


if __name__ == "__main__":
    failed = 0
    arguments = sys.argv[1:]
    for consolidated_path, gathered_path in zip(arguments[::2], arguments[1::2]):
        try:
            check(consolidated_path, gathered_path)
            print(f"{consolidated_path}: OK")
        except AssertionError:
            failed += 1
            print(f"{consolidated_path}: {traceback.format_exc(limit=1).strip().splitlines()[-1]}", flush=True)
    sys.exit(1 if failed else 0)
