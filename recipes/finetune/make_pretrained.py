"""A small "pretrained" Hugging Face model on disk, for fine-tuning without a network: built from a config,
trained for a few steps on counting sequences (next token = this one + 1), written by `save_pretrained` as bf16
safetensors shards with their index, as the Hub's checkpoints are.

    python -m recipes.finetune.make_pretrained pretrained/llama            # Llama, untied head
    python -m recipes.finetune.make_pretrained pretrained/qwen2 --model qwen2  # Qwen2, head tied to the embedding
    python -m recipes.finetune.make_pretrained pretrained/mixtral --model mixtral  # Mixtral: 4 experts, 2 a token

Its loss on counting sequences is far below a fresh model's (about 5.5), so a fine-tune's first loss shows which
weights it started from.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

VOCAB = 256
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
CONFIGS = {"llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
           "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
           # A mixture of experts whose `.loss` from `labels=` holds its router's load-balancing loss.
           "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True))}


def counting(rows: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """`rows` sequences of `length` tokens, each counting up (mod the vocabulary) from a random start."""
    return (torch.randint(0, VOCAB, (rows, 1), generator=generator) + torch.arange(length)) % VOCAB


def make_pretrained(folder: str | Path, model: str = "llama", steps: int = 30, seed: int = 0) -> float:
    """Write the model to `folder`; returns its loss on the last training batch."""
    import transformers

    config_class, extra = CONFIGS[model]
    torch.manual_seed(seed)
    network = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**SHAPE, **extra))
    optimizer = torch.optim.AdamW(network.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        ids = counting(16, 17, generator)
        loss = network(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    network.to(torch.bfloat16).save_pretrained(folder, max_shard_size="100KB")  # several shards and an index
    return loss.item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--model", choices=sorted(CONFIGS), default="llama")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    if Path(args.folder).exists() and any(Path(args.folder).iterdir()):
        parser.error(f"folder: {args.folder} is not empty; pass a new folder (nothing there is overwritten)")
    loss = make_pretrained(args.folder, args.model, args.steps)
    print(f"save_pretrained folder: {args.folder} ({args.model}, loss {loss:.3f} after {args.steps} steps)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
