"""QLoRA on a CUDA device, where bitsandbytes' CUDA kernels run: a 4-bit base (NF4) with LoRA, as users write it
(tests/finetune_script.py, `qlora`: float32 storage; `qlora_bf16`: bf16 storage and compute, bf16-mixed), trains
under ld_ddp from the 4-bit model's own first loss, and under ld_fsdp and ZeRO-3, which shard the base, with ddp's
losses; the packed base weights end unchanged. The CPU's runs of the same: tests/models/test_finetune_runs.py.
Needs bitsandbytes there (scripts/gpu_wheels.sh hf)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, TRAIN_ENV
from tests.models.conftest import make_pretrained

pytestmark = pytest.mark.gpu

STRATEGIES = ["ld_ddp", "ld_fsdp", "ld_deepspeed_stage_3"]
PLACES = ["qlora", "qlora_bf16"]


def finetune(out, folder, strategy: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "tests" / "finetune_script.py"), str(out), str(folder), strategy,
         ",".join(PLACES), "1", "gpu"],
        cwd=out, env={**TRAIN_ENV, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600)


def test_qlora_trains_under_ddp_fsdp_and_zero_3_on_a_gpu_with_ddp_s_losses(tmp_path, measurements):
    from tests.finetune_script import quantized_with_lora

    folder = tmp_path / "llama"
    make_pretrained(folder, "llama")
    results = {}
    for strategy in STRATEGIES:
        out = tmp_path / strategy
        out.mkdir()
        run = finetune(out, folder, strategy)
        assert run.returncode == 0, run.stderr[-4000:]
        results[strategy] = {place: json.loads((out / f"{place}.rank0.json").read_text()) for place in PLACES}
    model = quantized_with_lora(str(folder)).cuda()
    ddp = results["ld_ddp"]["qlora"]
    ids = torch.tensor(ddp["first_batch"], device="cuda")
    with torch.no_grad():
        expected = model(input_ids=ids, labels=ids).loss.item()
    measurements["qlora"] = {"plain_first_loss": expected,
                             "losses": {s: {p: r["losses"] for p, r in places.items()} for s, places in results.items()}}
    assert ddp["losses"][0] == pytest.approx(expected, rel=1e-3)
    for strategy, places in results.items():
        for place, result in places.items():
            assert all(math.isfinite(loss) and loss > 0 for loss in result["losses"])  # never the silent 0 or NaN
            assert result["base_unchanged"] and result["adapters_changed"], (strategy, place)
            reference = results["ld_ddp"][place]["losses"]
            assert result["losses"] == pytest.approx(reference, rel=1e-4 if place == "qlora" else 5e-3), (strategy,
                                                                                                          place)
