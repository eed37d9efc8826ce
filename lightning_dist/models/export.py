"""`lightning-dist export`: a checkpoint of a Hugging Face model (`model=hf_*`, with or without
`+lora=default`) as a `save_pretrained` folder, which `AutoModelForCausalLM.from_pretrained` (or Seq2SeqLM) loads:

    lightning-dist export OUT_DIR              # the newest run's checkpoints/last.ckpt (under ./logs)
    lightning-dist export CHECKPOINT OUT_DIR   # any strategy's checkpoint: a file, or an FSDP or DeepSpeed directory

The checkpoint is consolidated, the model rebuilt without memory from the hyper-parameters it saved, given its
weights (a LoRA run's adapters merged into them), and written by transformers itself, tied embeddings tied. A
folder that holds anything already is refused before the checkpoint is read: nothing is overwritten.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from lightning_dist.checkpoints.consolidate import load_consolidated
from lightning_dist.checkpoints.formats import CheckpointError
from lightning_dist.checkpoints.frozen_weights import LEFT_OUT
from lightning_dist.reports.runs import newest_run

LAST = "checkpoints/last.ckpt"


def hf_model_of(saved: dict[str, Any], checkpoint: str | Path) -> Any:
    """The transformers model in `saved` (a consolidated checkpoint of HFLanguageModel), its weights loaded and a
    LoRA run's adapters merged into them; a CheckpointError naming what it holds instead."""
    from lightning_dist.models.hf_language_model import WEIGHTS_PREFIX, build_language_model, with_lora
    from lightning_dist.parallel.sharded_init import parameters_on_meta

    hparams = saved.get("hyper_parameters") or {}
    if "model_type" not in hparams:
        held = "the bundled GPT" if "vocab_size" in hparams and "d_model" in hparams else "another model"
        raise CheckpointError(f"checkpoint: {checkpoint} holds {held}, not a Hugging Face model (model=hf_*);"
                              " `lightning-dist consolidate` writes any checkpoint as one file")
    if LEFT_OUT in saved:
        raise CheckpointError(f"checkpoint: {checkpoint} left its frozen weights out (exclude_frozen_parameters=True):"
                              " it resumes a run but holds no whole model; the run wrote its adapters to"
                              " <run dir>/adapters (PEFT's format, for the pretrained folder)")
    weights = {name.removeprefix(WEIGHTS_PREFIX): tensor for name, tensor in saved["state_dict"].items()
               if name.startswith(WEIGHTS_PREFIX)}
    pretrained = hparams.get("pretrained")
    if pretrained and not Path(pretrained, "config.json").is_file():
        raise CheckpointError(f"checkpoint: {checkpoint} was fine-tuned from {pretrained}, whose config.json is not"
                              " here; run the command where that folder is (its config is the model's)")
    model: Any  # a transformers model (PEFT's around it, for a LoRA run)
    with parameters_on_meta():  # the architecture only (its buffers made): the weights are the checkpoint's
        model = build_language_model(hparams["model_type"], hparams.get("config"), pretrained, weights=False)
        model = with_lora(model, hparams.get("lora"))
    base = model.get_base_model() if hparams.get("lora") else model
    head = base.get_output_embeddings()
    tied = head is not None and head.weight is base.get_input_embeddings().weight
    model.load_state_dict(weights, strict=True, assign=True)  # assign: the meta parameters take the saved tensors
    if hparams.get("lora"):
        # Folded into the weights they adapt, in the dtype they trained in (float32 beside a base kept in its bf16):
        # merged into the bf16 base, each sum was rounded to bf16 (logits 4e-3 from the base with the adapters).
        model = model.to(next(p.dtype for name, p in model.named_parameters() if "lora_" in name))
        model = model.merge_and_unload()  # a plain model again
    if tied:
        model.tie_weights()  # assign replaced both tied parameters: one again
    return model.eval()


def export(checkpoint: str | Path, out_dir: str | Path, trusted: bool = False) -> Path:
    """Write the Hugging Face model of `checkpoint` (any strategy's) to `out_dir` with `save_pretrained`."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"out_dir: {out_dir} is not empty; pass a new folder (nothing there is overwritten)")
    from transformers.utils import logging

    model = hf_model_of(load_consolidated(checkpoint, trusted), checkpoint)
    logging.disable_progress_bar()  # a bar per file written, on stderr, for a one-line command
    model.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-dist export", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", metavar="[CHECKPOINT] OUT_DIR",
                        help=f"a checkpoint (default: the newest run's {LAST}) and the folder to write")
    parser.add_argument("--trust-checkpoint", action="store_true",
                        help="load pickled objects other than tensors and plain data (runs code the file names)")
    args = parser.parse_args(argv)
    if len(args.paths) > 2:
        parser.error("give at most CHECKPOINT and OUT_DIR")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # a DeepSpeed checkpoint is read on the host
    checkpoint = args.paths[0] if len(args.paths) == 2 else newest_run(LAST) / LAST
    try:
        print(f"save_pretrained folder: {export(checkpoint, args.paths[-1], args.trust_checkpoint)}")
    except (CheckpointError, FileExistsError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
