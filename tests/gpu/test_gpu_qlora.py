"""QLoRA on a CUDA device, where bitsandbytes' CUDA kernels run: a 4-bit base (NF4, float32 storage) with LoRA, as
users write it (tests/finetune_script.py, `qlora`), trains under ld_ddp from the 4-bit model's own first loss, its
packed base weights unchanged; ld_fsdp refuses it in one line before it starts. The CPU's runs of the same:
tests/models/test_finetune_runs.py. Needs bitsandbytes there (scripts/gpu_wheels.sh hf)."""

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


def finetune(out, folder, strategy: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "tests" / "finetune_script.py"), str(out), str(folder), strategy, "qlora", "1",
         "gpu"], cwd=out, env={**TRAIN_ENV, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600)


def test_qlora_trains_under_ddp_on_a_gpu_and_is_refused_under_fsdp(tmp_path, measurements):
    from tests.finetune_script import quantized_with_lora

    folder = tmp_path / "llama"
    make_pretrained(folder, "llama")
    run = finetune(tmp_path, folder, "ld_ddp")
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads((tmp_path / "qlora.rank0.json").read_text())
    model = quantized_with_lora(str(folder)).cuda()
    ids = torch.tensor(result["first_batch"], device="cuda")
    with torch.no_grad():
        expected = model(input_ids=ids, labels=ids).loss.item()
    measurements["qlora"] = {"losses": result["losses"], "plain_first_loss": expected}
    assert all(math.isfinite(loss) and loss > 0 for loss in result["losses"])  # never the silent 0 or NaN
    assert result["losses"][0] == pytest.approx(expected, rel=1e-3)
    assert result["base_unchanged"] and result["adapters_changed"]
    assert result["optimizer_state_elements"] == 2 * result["adapter_parameters"]

    refused = finetune(tmp_path, folder, "ld_fsdp")
    assert refused.returncode != 0
    assert "is a bitsandbytes 4-bit weight stored as torch.float32, which this strategy would shard" in refused.stderr
