"""A checkpoint of any strategy (DDP file, FSDP or DeepSpeed directory) as a `save_pretrained` folder.

    python -m recipes.hf_causal_lm.export OUT_DIR              # the newest run's checkpoints/last.ckpt
    python -m recipes.hf_causal_lm.export CHECKPOINT OUT_DIR   # any checkpoint (file or directory)

The checkpoint is consolidated (lightning_dist.checkpoints), the model rebuilt without memory from the
hyper-parameters the checkpoint saved, given the weights (a LoRA run's adapters merged into them), and written by
transformers itself; so
`AutoModelForCausalLM.from_pretrained(OUT_DIR)` (or Seq2SeqLM) loads it, tied embeddings tied.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from lightning_dist.checkpoints.consolidate import load_consolidated
from lightning_dist.reports.runs import newest_run
from recipes.hf_causal_lm.language_model import build_language_model, with_lora

PREFIX = "model."  # LanguageModel keeps the transformers model as `self.model`
LAST = "checkpoints/last.ckpt"


def export(checkpoint: str | Path, out_dir: str | Path) -> Path:
    saved = load_consolidated(checkpoint)
    hparams = saved["hyper_parameters"]
    weights = {name.removeprefix(PREFIX): tensor for name, tensor in saved["state_dict"].items() if name.startswith(PREFIX)}
    with torch.device("meta"):  # its config only: the weights are the checkpoint's (a pretrained folder's are not read)
        model = build_language_model(hparams["model_type"], hparams.get("config"), hparams.get("pretrained"),
                                     weights=False)
        model = with_lora(model, hparams.get("lora"))
    base = model.get_base_model() if hparams.get("lora") else model
    head = base.get_output_embeddings()
    tied = head is not None and head.weight is base.get_input_embeddings().weight
    model.load_state_dict(weights, strict=True, assign=True)  # assign: the meta parameters take the saved tensors
    if hparams.get("lora"):
        model = model.merge_and_unload()  # the adapters folded into the weights they adapt: a plain model again
    if tied:
        model.tie_weights()  # assign replaced both tied parameters: one again
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"out_dir: {out_dir} is not empty; pass a new folder (nothing there is overwritten)")
    model.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", metavar="[CHECKPOINT] OUT_DIR",
                        help=f"a checkpoint (default: the newest run's {LAST}) and the folder to write")
    args = parser.parse_args(argv)
    if len(args.paths) > 2:
        parser.error("give at most CHECKPOINT and OUT_DIR")
    checkpoint = args.paths[0] if len(args.paths) == 2 else newest_run(LAST) / LAST
    print(f"save_pretrained folder: {export(checkpoint, args.paths[-1])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
