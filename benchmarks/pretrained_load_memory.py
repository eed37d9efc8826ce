"""Host memory of a node's ranks while a pretrained model loads, against the checkpoint's size.

    python -m benchmarks.pretrained_load_memory [--ranks 2 4] [--strategies ld_fsdp ld_deepspeed_stage_3]

A Llama of 168M parameters is written by `save_pretrained` in fp32 (0.67 GB, in shards with their index) unless
`--folder` names one. A user's LightningModule loads it in `configure_model`, under a plain `L.Trainer` on CPU ranks
of one node, for a validation pass (no optimizer state); each rank reports its resident memory before the model is
built (the fixed per-rank cost: Python, the framework, the process group) and its peak until the strategy has set
the model up (the model sharded and loaded). Two ways of loading, each at each world size:
- `ours`: `lightning_dist.from_pretrained(folder)`, read tensor by tensor into the shards each rank keeps;
- `transformers`: `AutoModelForCausalLM.from_pretrained(folder)`, whole on every rank until the strategy shards it.

Target (issue 59): the peak summed over the node's ranks at most 1.3x the checkpoint plus the fixed cost per rank,
whatever the number of ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET = 1.3
# 168M parameters: the embedding and the head (32,000 x 1,024) are 20% of it each, the largest tensors.
LARGE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=8, tie_word_embeddings=False)


def write_checkpoint(folder: Path, shape: dict, dtype: str = "fp32") -> int:
    """A random Llama of `shape`, saved in `dtype` (fp32 or bf16); returns the bytes of its safetensors files."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape))
    model.to(torch.bfloat16 if dtype == "bf16" else torch.float32).save_pretrained(folder, max_shard_size="200MB")
    return checkpoint_bytes(folder)


def checkpoint_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


def rank_main(folder: str, strategy: str, loader: str, out: str, devices: str) -> None:
    """One run of a user's module (every rank runs this): writes out/rank<N>.json with the rank's resident memory
    before the model is built and its peak until the strategy has set it up (the peak reset in between: Linux's
    `clear_refs`). A validation pass: no optimizer, whose state ZeRO-3 would allocate at set-up."""
    import lightning as L
    import torch
    from transformers import AutoModelForCausalLM

    import lightning_dist

    class FineTune(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:
            if self.model is None:
                self.before = _status("VmRSS")
                Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) from here on
                self.model = lightning_dist.from_pretrained(folder) if loader == "ours" else \
                    AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

        def on_validation_start(self) -> None:
            record = {"before": self.before, "peak": _status("VmHWM")}
            Path(out, f"rank{self.global_rank}.json").write_text(json.dumps(record))

        def validation_step(self, batch, batch_idx):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

    tokens = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=1)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=int(devices), limit_val_batches=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.validate(FineTune(), data)


def _status(field: str) -> int:
    """A field of /proc/self/status, in bytes."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def peaks(folder: Path, strategy: str, loader: str, ranks: int) -> list[dict]:
    """Each rank's resident memory before the model is built and its peak until set up (bytes), for one run."""
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, "-m", "benchmarks.pretrained_load_memory", "rank", str(folder),
                               strategy, loader, out, str(ranks)], cwd=out, env=env, capture_output=True, text=True,
                              timeout=1800)
        if done.returncode:
            raise RuntimeError(f"{strategy} {loader} on {ranks} ranks exited {done.returncode}: {done.stderr[-3000:]}")
        return [json.loads(Path(out, f"rank{rank}.json").read_text()) for rank in range(ranks)]


def summed(records: list[dict]) -> tuple[int, int]:
    """(the peaks summed over the ranks, the largest resident memory a rank had before the model: the fixed cost)"""
    return sum(r["peak"] for r in records), max(r["before"] for r in records)


def measure(folder: Path, strategies: list[str], ranks: list[int]) -> list[dict]:
    """A row per strategy, loader and world size: the summed peak against the target."""
    size = checkpoint_bytes(folder)
    rows = []
    for strategy in strategies:
        for count in ranks:
            for loader in ("ours", "transformers"):
                peak, fixed = summed(peaks(folder, strategy, loader, count))
                rows.append({"strategy": strategy, "ranks": count, "loader": loader, "checkpoint": size,
                             "fixed_per_rank": fixed, "summed_peak": peak, "ratio": (peak - count * fixed) / size,
                             "within_target": peak <= TARGET * size + count * fixed})
    return rows


def table(rows: list[dict]) -> str:
    gb = 1e9
    lines = ["| strategy | ranks | loader | peak RSS summed (GB) | fixed per rank (GB) |"
             " (sum - fixed x ranks) / checkpoint | within 1.3x |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        within = "yes" if row["within_target"] else "no"
        lines.append(f"| {row['strategy']} | {row['ranks']} | {row['loader']} | {row['summed_peak'] / gb:.2f} |"
                     f" {row['fixed_per_rank'] / gb:.2f} | {row['ratio']:.2f} | {within} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "rank":
        rank_main(*argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, help="a save_pretrained folder (default: one written here, 0.67 GB)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--strategies", nargs="+", default=["ld_fsdp", "ld_deepspeed_stage_3"])
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the checkpoint's, on disk")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.folder or Path(scratch, "large")
        if args.folder is None:
            write_checkpoint(folder, LARGE, args.dtype)
        rows = measure(folder, args.strategies, args.ranks)
    print(f"checkpoint: {rows[0]['checkpoint'] / 1e9:.2f} GB of safetensors ({args.dtype}); the run in fp32")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
