"""Load a consolidated checkpoint the way a user would after training: a fresh process, no process group, no
DeepSpeed. Compares it with the weights gathered at the end of training. Prints OK or fails an assertion."""

import sys

import torch

from tests.models.checkpoint_probe import CheckpointProbeGPT

consolidated_path, gathered_path = sys.argv[1:3]
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
assert model.model.lm_head.weight is model.model.token_embedding.weight  # still tied
assert model.bytes_seen.sum() > 0  # the buffer came back with its values, not re-initialised
assert "deepspeed" not in sys.modules and not torch.distributed.is_initialized()
print("OK")
