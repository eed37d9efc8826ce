"""A few tokens from a fine-tuned model: the pretrained folder with a run's LoRA adapters (PEFT's format), or a
merged export on its own. Byte-level: the prompt is text, each token a byte.

    python -m recipes.finetune.generate pretrained/llama --adapters newest  # with the newest run's adapters
    python -m recipes.finetune.generate pretrained/llama --adapters DIR     # with these adapters
    python -m recipes.finetune.generate merged                              # a merged export (no adapters)
"""

from __future__ import annotations

import argparse

import torch

from lightning_dist.reports.runs import newest_run

ADAPTERS = "adapters"


def generate(folder: str, adapters: str | None, prompt: str, tokens: int) -> str:
    """`tokens` new bytes after `prompt`, greedily, from the model in `folder` (with `adapters`, if given)."""
    import lightning_dist

    model = lightning_dist.from_pretrained(folder)
    if adapters is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapters)
    ids = torch.tensor([list(prompt.encode())])
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
    return bytes(out[0, ids.shape[1]:].tolist()).decode(errors="replace")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="a save_pretrained folder: the pretrained model, or a merged export")
    parser.add_argument("--adapters", help="a PEFT adapter folder, or `newest`: the newest run's (default: none)")
    parser.add_argument("--prompt", default="The ")
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args(argv)
    adapters = args.adapters
    if adapters == "newest":
        adapters = str(newest_run(f"{ADAPTERS}/adapter_config.json") / ADAPTERS)
    text = generate(args.folder, adapters, args.prompt, args.tokens)
    print(f"{args.folder}{' + ' + adapters if adapters else ''}: {args.prompt!r} -> {text!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
