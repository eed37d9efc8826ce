"""Text from a model a run trained, the first "did it learn?" after training:

    lightning-dist generate logs/train/runs/<time>/checkpoints/last.ckpt --prompt "The "
    lightning-dist generate CHECKPOINT --tokens 400 --temperature 0.8 --seed 1
    lightning-dist generate pretrained/llama --adapters newest   # a save_pretrained folder, a LoRA run's adapters
    lightning-dist generate merged                              # a folder `lightning-dist export` wrote

CHECKPOINT is any checkpoint our strategies write (a DDP file, an FSDP or DeepSpeed directory, a consolidated
file) of the bundled GPT or of a Hugging Face model (`model=hf_*`, LoRA adapters merged); a folder is a
`save_pretrained` one, with `--adapters` a PEFT adapter folder (`newest`: the newest run's). Text goes in and out
through the folder's tokenizer where it has one; a byte-level model (a vocabulary of 256, as the bundled models
have) reads the prompt as UTF-8 and writes bytes (one that is no character shows as U+FFFD). Greedy unless
`--temperature` is above 0. Run on the host unless `--device` says otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_dist.checkpoints.consolidate import load_consolidated
from lightning_dist.checkpoints.formats import CheckpointError
from lightning_dist.models.gpt import GPT
from lightning_dist.reports.runs import newest_run

_ARCHITECTURE = ("vocab_size", "block_size", "n_layer", "n_head", "d_model")
_PREFIX = "model."  # GPTLanguageModel keeps its GPT as `self.model`
_BYTES = 256  # a byte-level vocabulary
_ADAPTERS = "adapters"  # where a LoRA run writes them in its run directory (HFLanguageModel)
_DEFAULT_TOKENS = 200


class ByteText:
    """A byte-level model's text: a token per byte of UTF-8."""

    @staticmethod
    def encode(text: str) -> list[int]:
        return list(text.encode())

    @staticmethod
    def decode(tokens: list[int]) -> str:
        return bytes(tokens).decode(errors="replace")


class TokenizerText:
    """A tokenizer's text (the folder's own, as transformers saves it)."""

    def __init__(self, folder: str | Path) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(folder)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))


def load_gpt(checkpoint: str | Path, trusted: bool = False) -> GPT:
    """The bundled GPT of `checkpoint`, its weights loaded, in eval mode on the host; a CheckpointError saying so
    where the checkpoint holds another model."""
    return _gpt_of(load_consolidated(checkpoint, trusted), checkpoint)


def _gpt_of(saved: dict[str, Any], checkpoint: str | Path) -> GPT:
    hparams = saved.get("hyper_parameters") or {}
    weights = {name.removeprefix(_PREFIX): tensor for name, tensor in saved["state_dict"].items()
               if name.startswith(_PREFIX)}
    if any(key not in hparams for key in _ARCHITECTURE) or hparams["vocab_size"] != _BYTES:
        raise CheckpointError(f"checkpoint: {checkpoint} holds neither the bundled GPT nor a Hugging Face model"
                              " (its hyper-parameters name no model_type, and lack"
                              f" {', '.join(k for k in _ARCHITECTURE if k not in hparams) or 'vocab_size=256'})")
    model = GPT(**{key: hparams[key] for key in _ARCHITECTURE}, dropout=0.0)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint: {checkpoint} does not hold the bundled GPT's weights"
                              f" ({len(missing)} of its keys missing, {len(unexpected)} unknown, e.g."
                              f" {(missing or unexpected)[0]})")
    return model.eval()


def load_model(path: str | Path, adapters: str | Path | None = None,
               trusted: bool = False) -> tuple[torch.nn.Module, ByteText | TokenizerText]:
    """The model at `path` (a checkpoint of the bundled GPT or of a Hugging Face model, or a `save_pretrained`
    folder with `adapters` on it) in eval mode on the host, and how its text is read and written."""
    path = Path(path)
    if (path / "config.json").is_file():
        return _from_folder(path, adapters)
    if adapters is not None:
        raise ValueError(f"--adapters: {path} is a checkpoint, which holds a LoRA run's adapters already; adapters go"
                         " on a save_pretrained folder")
    saved = load_consolidated(path, trusted)
    if "model_type" not in (saved.get("hyper_parameters") or {}):
        return _gpt_of(saved, path), ByteText()
    from lightning_dist.models.export import hf_model_of

    model = hf_model_of(saved, path)
    return model, _text_of(model, saved["hyper_parameters"].get("pretrained"), path)


def _from_folder(folder: Path, adapters: str | Path | None) -> tuple[torch.nn.Module, ByteText | TokenizerText]:
    from lightning_dist.models.pretrained import from_pretrained

    model = from_pretrained(folder, key="folder")
    if adapters is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapters))
    return model.eval(), _text_of(model, folder, folder)


def _text_of(model: Any, folder: str | Path | None, named: Path) -> ByteText | TokenizerText:
    """The tokenizer saved in `folder`, else bytes for a byte-level model; a ValueError where neither is."""
    if folder is not None and any(Path(folder, name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return TokenizerText(folder)
    vocabulary = model.config.vocab_size
    if vocabulary == _BYTES:
        return ByteText()
    raise ValueError(f"{named}: its model reads {vocabulary} tokens and no tokenizer is saved beside it (no"
                     f" tokenizer.json in {folder or 'a folder it names'}); save its tokenizer there"
                     " (`tokenizer.save_pretrained(folder)`)")


@torch.no_grad()
def generate(model: torch.nn.Module, prompt: str, new_tokens: int | None = None, temperature: float = 0.0,
             seed: int = 0, text: ByteText | TokenizerText | None = None) -> str:
    """`prompt` and the `new_tokens` tokens `model` writes after it (bytes, for a byte-level model): the likeliest
    each time, or drawn at `temperature`. Unset: 200, or as many as the model's positions leave after the prompt."""
    if not prompt:
        raise ValueError("prompt: give at least one character to start from")
    text = text or ByteText()
    tokens = torch.tensor([text.encode(prompt)], device=next(model.parameters()).device)
    if isinstance(model, GPT):
        written = _gpt_tokens(model, tokens, _DEFAULT_TOKENS if new_tokens is None else new_tokens, temperature, seed)
    else:
        written = _hf_tokens(model, tokens, new_tokens, temperature, seed)
    return text.decode(tokens[0].tolist() + written)  # whole: a tokenizer spaces the words it joins


def _gpt_tokens(model: GPT, tokens: torch.Tensor, new_tokens: int, temperature: float, seed: int) -> list[int]:
    generator = torch.Generator(tokens.device).manual_seed(seed)
    prompt_length = tokens.shape[1]
    for _ in range(new_tokens):
        logits = model(tokens[:, -model.block_size:])[:, -1].float()
        if temperature > 0:
            following = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)
        else:
            following = logits.argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, following], dim=1)
    return tokens[0, prompt_length:].tolist()


def _hf_tokens(model: Any, tokens: torch.Tensor, new_tokens: int | None, temperature: float, seed: int) -> list[int]:
    """transformers' own `generate`, with exactly the choices given (not those of a saved generation_config)."""
    from transformers import GenerationConfig

    config = model.config
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if config.is_encoder_decoder:
        positions = None  # its decoder's positions start after the start token, not after the prompt
    if new_tokens is None:
        new_tokens = _DEFAULT_TOKENS if positions is None else max(0, min(_DEFAULT_TOKENS, positions - tokens.shape[1]))
    if positions is not None and tokens.shape[1] + new_tokens > positions:
        raise ValueError(f"--tokens: the model reads at most {positions} positions (its config's"
                         f" max_position_embeddings), and the prompt's {tokens.shape[1]} tokens and {new_tokens} new"
                         f" ones are more; ask for at most {positions - tokens.shape[1]}")
    choices = GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None, top_k=None, top_p=None,
        pad_token_id=config.pad_token_id if config.pad_token_id is not None else 0,
        eos_token_id=config.eos_token_id, decoder_start_token_id=getattr(config, "decoder_start_token_id", None),
    )
    torch.manual_seed(seed)
    written = model.generate(input_ids=tokens, attention_mask=torch.ones_like(tokens), generation_config=choices)
    # A decoder-only model's output starts with the prompt; an encoder-decoder's with its decoder's start token.
    start = 1 if config.is_encoder_decoder else tokens.shape[1]
    return written[0, start:].tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-dist generate", description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a checkpoint (file or directory), or a save_pretrained folder")
    parser.add_argument("--adapters", help="with a folder: a PEFT adapter folder, or `newest` (the newest run's)")
    parser.add_argument("--prompt", default="The ", help="the text it continues (default: %(default)r)")
    parser.add_argument("--tokens", "--bytes", type=int, dest="new_tokens",
                        help=f"how many tokens to write (bytes, for a byte-level model); default {_DEFAULT_TOKENS}, or"
                             " as many as the model's positions leave after the prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): the likeliest token each time")
    parser.add_argument("--seed", type=int, default=0, help="of the draws, where --temperature is above 0")
    parser.add_argument("--device", default="cpu", help="where the model runs (default: %(default)s; e.g. cuda)")
    parser.add_argument("--trust-checkpoint", action="store_true",
                        help="load pickled objects other than tensors and plain data (runs code the file names)")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # a DeepSpeed checkpoint is read on the host
    adapters = args.adapters
    if adapters == "newest":
        adapters = newest_run(f"{_ADAPTERS}/adapter_config.json") / _ADAPTERS
    try:
        model, text = load_model(args.path, adapters, args.trust_checkpoint)
        model = model.to(args.device)
        print(generate(model, args.prompt, args.new_tokens, args.temperature, args.seed, text))
    except (CheckpointError, ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
