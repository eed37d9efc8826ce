"""transformers' `generate` in a user's `validation_step` (during fit) and `predict_step`, on 2 CPU ranks whose
texts end at different lengths (tests/generate_script.py): under ZeRO-3 the rank that finished first stopped taking
part in the parameter gathers, and the other waited on it (a hang on GPUs; "Connection closed by peer" on gloo), as
transformers only keeps ranks in step (`synced_gpus`) under a DeepSpeed config it knows of. FSDP2 marks the modules
it manages, which transformers reads too."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, TRAIN_ENV

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("strategy", ["ld_deepspeed_stage_3", "ld_fsdp"])
def test_each_rank_writes_its_own_text_to_its_end(strategy, tmp_path, deepspeed_ops):
    import torch

    from tests.generate_script import NEW_TOKENS, PROMPTS, build, eos_token

    process = subprocess.run([sys.executable, str(REPO / "tests" / "generate_script.py"), str(tmp_path), strategy],
                             cwd=tmp_path, env={**TRAIN_ENV, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                             timeout=300)
    assert process.returncode == 0, process.stderr[-4000:]
    with torch.no_grad():
        reference = build().generate(input_ids=PROMPTS[1:], max_new_tokens=NEW_TOKENS, do_sample=False,
                                     pad_token_id=0)[0].tolist()
    expected = [PROMPTS[0].tolist() + [eos_token()], reference]  # rank 0's text ends at its first new token
    assert len(expected[1]) == PROMPTS.shape[1] + NEW_TOKENS and eos_token() not in reference[PROMPTS.shape[1]:]
    for rank in range(2):
        written = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert written == {"validation": [expected[rank]], "predict": [expected[rank]]}
