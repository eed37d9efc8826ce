"""The norm of sharded gradients (lightning_dist/parallel/grad_norm.py) is the norm of the whole tensors, on every
rank, for every layout our strategies give gradients: it is computed from each rank's local shards, reduced over the
mesh dimensions that shard them (not DTensor's own computation, whose dispatch cost a millisecond or two a step)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO

LAYOUTS = ["fsdp", "replicated", "hsdp", "fsdp_tp", "fsdp_tp_row_bias", "fsdp_tp_strided", "mixed", "two_meshes"]


@pytest.mark.slow
def test_the_norm_of_sharded_gradients_is_the_whole_tensors_norm_on_every_rank(tmp_path):
    out = tmp_path / "norms.json"
    run = subprocess.run([sys.executable, "-m", "tests.parallel.grad_norm_ranks", str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(out.read_text())
    assert found["same_on_every_rank"]
    norms = found["rank0"]
    assert sorted(norms) == sorted([*LAYOUTS, "partial", "refusal"])
    for layout in LAYOUTS:
        assert sorted(norms[layout]) == ["1", "2", "3", "inf"]
        for norm_type, (ours, whole) in norms[layout].items():
            # float32 sums in another order: within a few units in the last place of ~10 (the 1-norm: of ~96)
            assert ours == pytest.approx(whole, rel=3e-7), (layout, norm_type)
    ours, whole = norms["partial"]["2"]
    assert ours == pytest.approx(whole, rel=3e-7)
    # A wrong rule for a placement (here: shards taken for copies) stops the run at its set-up, naming the count.
    # Rank 0 holds 2 rows of 7, 1 of 3, 4 of 16, the scalar, 1 of 2 and 2 of 8: 12 + 1 + 16 + 1 + 9 + 10 = 49 of 168.
    assert norms["refusal"] == ("the gradient norm of 6 parameters placed (Replicate(),) on a (4,) mesh would count 49"
                                f" elements of their 168 (torch {torch.__version__}):"
                                " lightning_dist/parallel/grad_norm.py needs that placement's rule")
