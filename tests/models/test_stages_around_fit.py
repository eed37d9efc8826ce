"""A user's fine-tune run as lightning-hydra-template runs one (tests/stages_script.py): validate, fit, test on the
best checkpoint, predict, on 2 CPU ranks, with transformers' own `from_pretrained` of a bf16 folder (Qwen2: its head
tied to the embedding) and a functools.partial optimizer in the hyperparameters. Every engine gives ddp's numbers at
every stage, and trains the weights in fp32 under 32-true."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, TRAIN_ENV

pytestmark = pytest.mark.slow

STRATEGIES = ["ld_ddp", "ld_fsdp", "ld_deepspeed_stage_2", "ld_deepspeed_stage_3"]


@pytest.fixture(scope="module")
def results(pretrained_folders, tmp_path_factory, deepspeed_ops):
    """{strategy: [each rank's result]}, each run made on first use."""

    class Results(dict):
        def __missing__(self, strategy):
            out = tmp_path_factory.mktemp(strategy)
            process = subprocess.run(
                [sys.executable, str(REPO / "tests" / "stages_script.py"), str(out), str(pretrained_folders["qwen2"]),
                 strategy], cwd=out, env={**TRAIN_ENV, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                timeout=900)
            assert process.returncode == 0, process.stderr[-4000:]
            self[strategy] = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
            self[strategy][0]["out"] = out
            return self[strategy]

    return Results()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_validate_fit_test_on_the_best_checkpoint_and_predict_give_ddp_s_numbers(results, strategy):
    reference = results["ld_ddp"][0]
    for rank in results[strategy]:
        # ZeRO-3 stopped at fit after validate (its config resolved without the train loader), then at the test's
        # load of its own checkpoint ('DeepSpeedZeRoOffload' object has no attribute '_restore_from_bit16_weights');
        # every strategy refused the checkpoint it had just saved, for the functools.partial in its hyperparameters.
        assert rank["validate_before"] == pytest.approx(reference["validate_before"], rel=1e-5)
        assert rank["best_score"] == pytest.approx(reference["best_score"], rel=1e-5)
        assert rank["best_score"] < rank["validate_before"] - 0.05  # trained
        assert rank["test"] == pytest.approx(rank["best_score"], rel=1e-5)  # the best checkpoint's weights, tested
        assert rank["predictions"] == [[4, 16]] * 4


@pytest.mark.parametrize("strategy", ["ld_ddp", "ld_fsdp"])
def test_bf16_weights_train_in_fp32_under_32_true(results, strategy):
    # transformers loads the folder in its bf16; under ddp and fsdp they trained so, AdamW's small updates rounded
    # away, while DeepSpeed trained fp32 weights: the same module gave other losses by strategy.
    for rank in results[strategy]:
        assert rank["trainable_dtypes"] == ["torch.float32"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_save_pretrained_writes_the_tested_weights_whole(results, strategy):
    import torch
    from transformers import AutoModelForCausalLM

    from tests.stages_script import loader

    (tokens,) = loader().dataset.tensors
    rank = results[strategy][0]
    for folder, dtype, rel in (("exported", torch.float32, 1e-5), ("exported-bf16", torch.bfloat16, 2e-2)):
        model = AutoModelForCausalLM.from_pretrained(rank["out"] / folder)  # in the dtype its config says
        assert {p.dtype for p in model.parameters()} == {dtype}
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # Qwen2's tied head
        with torch.no_grad():
            loss = model(input_ids=tokens, labels=tokens).loss.item()
        # Every token weighs the same in the test's mean over equal batches and ranks: the whole set's loss.
        assert loss == pytest.approx(rank["test"], rel=rel)
