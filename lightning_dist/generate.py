"""Text from the bundled GPT a run trained, the first "did it learn?" after training:

    lightning-dist generate logs/train/runs/<time>/checkpoints/last.ckpt --prompt "The "
    lightning-dist generate CHECKPOINT --bytes 400 --temperature 0.8 --seed 1

Any checkpoint our strategies write of it (a DDP file, an FSDP or DeepSpeed directory, a consolidated file). The
GPT reads and writes bytes: the prompt is encoded as UTF-8, and what follows it is decoded so (a byte sequence that
is no character shows as U+FFFD). Greedy unless `--temperature` is above 0. A Hugging Face model's checkpoint is
exported first (`python -m recipes.hf_causal_lm.export`) and generates with transformers' `generate`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from lightning_dist.checkpoints.consolidate import load_consolidated
from lightning_dist.checkpoints.formats import CheckpointError
from lightning_dist.models.gpt import GPT

_ARCHITECTURE = ("vocab_size", "block_size", "n_layer", "n_head", "d_model")
_PREFIX = "model."  # GPTLanguageModel keeps its GPT as `self.model`


def load_gpt(checkpoint: str | Path, trusted: bool = False) -> GPT:
    """The bundled GPT of `checkpoint`, its weights loaded, in eval mode on the host; a CheckpointError saying so
    where the checkpoint holds another model."""
    saved = load_consolidated(checkpoint, trusted)
    hparams = saved.get("hyper_parameters") or {}
    weights = {name.removeprefix(_PREFIX): tensor for name, tensor in saved["state_dict"].items()
               if name.startswith(_PREFIX)}
    if any(key not in hparams for key in _ARCHITECTURE) or hparams["vocab_size"] != 256:
        raise CheckpointError(f"checkpoint: {checkpoint} is not of the bundled byte-level GPT (its hyper-parameters"
                              f" lack {', '.join(k for k in _ARCHITECTURE if k not in hparams) or 'vocab_size=256'});"
                              " a Hugging Face model's: export it (python -m recipes.hf_causal_lm.export) and call"
                              " its generate")
    model = GPT(**{key: hparams[key] for key in _ARCHITECTURE}, dropout=0.0)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint: {checkpoint} does not hold the bundled GPT's weights"
                              f" ({len(missing)} of its keys missing, {len(unexpected)} unknown, e.g."
                              f" {(missing or unexpected)[0]})")
    return model.eval()


@torch.no_grad()
def generate(model: GPT, prompt: str, new_bytes: int = 200, temperature: float = 0.0, seed: int = 0) -> str:
    """`prompt` and the `new_bytes` bytes `model` writes after it: the likeliest each time, or drawn at
    `temperature`."""
    if not prompt:
        raise ValueError("prompt: give at least one character to start from")
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.tensor([list(prompt.encode())])
    for _ in range(new_bytes):
        logits = model(tokens[:, -model.block_size:])[:, -1].float()
        if temperature > 0:
            following = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)
        else:
            following = logits.argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, following], dim=1)
    return bytes(tokens[0].tolist()).decode(errors="replace")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-dist generate",
                                     description="Text from the bundled GPT of a checkpoint (any strategy's).")
    parser.add_argument("checkpoint", type=Path, help="a .ckpt file, or a DeepSpeed or FSDP checkpoint directory")
    parser.add_argument("--prompt", default="The ", help="the text it continues (default: %(default)r)")
    parser.add_argument("--bytes", type=int, default=200, dest="new_bytes", help="how many bytes to write")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): the likeliest byte each time")
    parser.add_argument("--seed", type=int, default=0, help="of the draws, where --temperature is above 0")
    parser.add_argument("--trust-checkpoint", action="store_true",
                        help="load pickled objects other than tensors and plain data (runs code the file names)")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # a DeepSpeed checkpoint is read on the host
    try:
        model = load_gpt(args.checkpoint, args.trust_checkpoint)
        print(generate(model, args.prompt, args.new_bytes, args.temperature, args.seed))
    except (CheckpointError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
