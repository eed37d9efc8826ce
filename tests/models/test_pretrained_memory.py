"""Loading a pretrained checkpoint (bf16 on disk, as the Hub's are) into an fp32 run under fsdp on 2 CPU ranks of
one node: with `lightning_dist.from_pretrained` no rank holds the whole model, only its shard and a few full tensors
at a time; transformers' `from_pretrained` holds it whole on every rank until it is sharded. The scaled-down
`benchmarks/pretrained_load_memory.py` (its tables, at 0.67 GB and 4 ranks, are in BENCHMARKS.md)."""

from __future__ import annotations

import pytest

from benchmarks.pretrained_load_memory import checkpoint_bytes, peaks, write_checkpoint

pytestmark = pytest.mark.slow

# 27.5M parameters: 0.055 GB in bf16, 0.11 GB in fp32; the largest tensors (the embedding, the head) 16 MB in fp32.
SHAPE = dict(vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=8, tie_word_embeddings=False)
LARGEST = 8000 * 512 * 4


def test_no_rank_holds_the_whole_model_while_it_loads(tmp_path):
    size = write_checkpoint(tmp_path / "model", SHAPE, "bf16")
    assert size == checkpoint_bytes(tmp_path / "model") and 0.05e9 < size < 0.06e9
    fp32 = 2 * size
    # Each rank's peak over its memory before the model was built (measured: 96 and 108 MB, and 184 and 182 MB).
    ours = [r["peak"] - r["before"] for r in peaks(tmp_path / "model", "ld_fsdp", "ours", 2)]
    whole = [r["peak"] - r["before"] for r in peaks(tmp_path / "model", "ld_fsdp", "transformers", 2)]
    for grown in ours:
        assert grown < fp32 / 2 + 5 * LARGEST, (grown, fp32)  # its shard, and a few full tensors at a time
    for grown in whole:
        assert grown > fp32, (grown, fp32)  # the whole model, converted: what the shard-by-shard load avoids
    assert sum(ours) < 0.7 * sum(whole)
