"""Lightning's weight averaging as a user adds it (`EMAWeightAveraging`, validation and a `ModelCheckpoint` every 2
steps; tests/weight_averaging_script.py): ld_ddp, and ld_fsdp with its copy sharded as the model is
(strategies/torch/sharded_average.py), validate, save, test and resume as Lightning's ddp does; the other engines stop
the launch in one line, before any rank starts (strategies/weight_averaging.py). Before: under ld_fsdp the first
update stopped the run (`aten.copy_.default got mixed torch.Tensor and DTensor`), under ZeRO-3 the averaged model
tested another loss than ddp's without a word, and under ZeRO-1/2 the checkpoints lost the average (testing one
stopped with `KeyError: 'state_dict'`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_dist.strategies.torch.sharded_average import ShardedAverages, _copy_of
from tests.conftest import REPO, TRAIN_ENV, run_train

SCRIPT = REPO / "tests" / "weight_averaging_script.py"


def _run(out: Path, strategy: str, callback: str = "ema", *more: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(out), strategy, callback, *more], cwd=REPO,
                          env={**TRAIN_ENV, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # real runs on 2 CPU ranks
def test_ld_ddp_and_ld_fsdp_average_validate_save_test_and_resume_as_lightning_s_ddp(tmp_path):
    """`compiled`: the module compiles its transformers model, whose sharded checkpoints name its weights without
    torch.compile's `_orig_mod.`, and ld_ddp's files with it: every test and resume of an ld_fsdp one stopped
    (`Missing key(s) in state_dict`), and a resume under the other engine (`the checkpoint has no optimizer state
    for model._orig_mod...`, `Missing key: model.model.embed_tokens.weight`). ZeRO-2 (strategies/deepspeed/
    average.py) had lost the average from its checkpoints (testing one stopped: `KeyError: 'state_dict'`); its
    checkpoint resumes under ld_ddp too (read consolidated), and ld_ddp's under ZeRO-2."""
    results = {}
    for run in ("ddp", "ld_ddp compiled resume=ld_fsdp,ld_deepspeed_stage_2", "ld_fsdp", "ld_fsdp_one_file",
                "ld_fsdp compiled resume=ld_fsdp,ld_ddp",
                "ld_deepspeed_stage_2 resume=ld_deepspeed_stage_2,ld_ddp"):  # Lightning's ddp: the reference
        name = " ".join(part for part in run.split() if not part.startswith("resume="))
        out = tmp_path / name.replace(" ", "_")
        process = _run(out, *run.split()[:1], "ema", *run.split()[1:])
        assert process.returncode == 0, process.stderr[-3000:]
        results[name] = json.loads((out / "result.json").read_text())
    ddp = results["ddp"]
    assert ddp["validated"][0] != pytest.approx(ddp["validated"][1])  # the average after 2 steps, then after 4
    assert ddp["step 2"] != pytest.approx(ddp["step 4"])  # each checkpoint its own weights
    assert ddp["step 4"] != pytest.approx(ddp["model"])  # ... which are not the average: that is the model at the end
    assert ddp["step 4 alone"] == pytest.approx(ddp["model"], rel=1e-6)  # the last checkpoint's state_dict: the average
    across = [results[run].pop(f"resumed under {under}") for run, under in (
        ("ld_fsdp compiled", "ld_ddp"), ("ld_deepspeed_stage_2", "ld_ddp"), ("ld_ddp compiled", "ld_deepspeed_stage_2"))]
    for strategy in ("ld_ddp compiled", "ld_fsdp", "ld_fsdp_one_file", "ld_fsdp compiled", "ld_deepspeed_stage_2"):
        resumed = results[strategy].pop("resumed")
        assert results[strategy] == pytest.approx({k: v for k, v in ddp.items() if k != "resumed"}, rel=1e-6), strategy
        # Resumed from step 2, the fit validates and ends as the one that ran on (Lightning's ddp began the epoch
        # again, its batches seen twice: another average)
        assert resumed == pytest.approx({"validated": ddp["validated"][1:], "model": ddp["model"]}, rel=1e-6), strategy
    for resumed in across:
        assert resumed == pytest.approx({"validated": ddp["validated"][1:], "model": ddp["model"]}, rel=1e-6)
    assert ddp["resumed"]["model"] != pytest.approx(ddp["model"])


# The best checkpoint by the highest validation loss: step 3's, which the fit's test then loads.
EMA_RUN = ("callbacks=[default,ema]", "callbacks.ema.decay=0.5", "trainer.max_steps=6", "trainer.val_check_interval=3",
           "model=hf_llama", "+lora=default", "strategy.exclude_frozen_parameters=true",
           "callbacks.model_checkpoint.every_n_train_steps=3", "callbacks.model_checkpoint.save_top_k=-1",
           "callbacks.model_checkpoint.mode=max")


@pytest.mark.slow
def test_the_ema_callbacks_option_trains_tests_and_resumes_a_lora_fine_tune_under_fsdp_as_under_ddp(tmp_path):
    """`python train.py 'callbacks=[default,ema]' strategy=fsdp`, a LoRA fine-tune whose checkpoints leave the frozen
    base out: the model built on the meta device, its average made from the shards once they are initialised. The
    fit tests its best checkpoint's average, what validation chose it by and what a test of the checkpoint alone
    (train=false) measures: the callback, left in the Trainer, restored the weights trained on (1e-2 apart). The
    checkpoint at step 3 resumes under fsdp and under ddp (read on rank 0: the callback's load on the other ranks
    stopped with `'NoneType' object has no attribute 'items'`, and its strict load wanted the base the save left
    out). Under ZeRO-2 the average is kept beside the engine's weights, the frozen base left out of both."""
    runs = {strategy: run_train(tmp_path / strategy, f"strategy={strategy}", *EMA_RUN)
            for strategy in ("ddp", "fsdp", "deepspeed_stage_2")}
    step_3 = tmp_path / "fsdp" / "checkpoints" / "step000003.ckpt"
    runs |= {f"{strategy} resumed": run_train(tmp_path / f"{strategy}_resumed", f"strategy={strategy}", *EMA_RUN,
                                              f"ckpt_path={step_3}") for strategy in ("ddp", "fsdp")}
    runs["fsdp tested alone"] = run_train(tmp_path / "alone", "strategy=fsdp", *EMA_RUN, "train=false",
                                          f"ckpt_path={step_3}")
    for name, run in runs.items():
        assert run.process.returncode == 0, (name, run.output[-3000:])
        # What PEFT's import of bitsandbytes logged on a CPU, and transformers about a property PEFT reads: silenced
        assert "gemm_4bit_forward" not in run.output and "is deprecated" not in run.output, name
    validated, tested = runs["ddp"].val_losses(), runs["ddp"].summary["metrics"]["test_loss"]
    assert sorted(validated) == [2, 5]  # after the third step and the sixth
    assert runs["fsdp"].summary["best_checkpoint"] == str(step_3)
    assert f"Tested the best checkpoint, {step_3}, as validated: the average EMAWeightAveraging kept" in (
        runs["fsdp"].output)
    for name in ("fsdp", "deepspeed_stage_2"):
        assert runs[name].val_losses() == pytest.approx(validated, rel=1e-6), name
    for name in ("fsdp", "fsdp tested alone", "deepspeed_stage_2"):
        assert runs[name].summary["metrics"]["test_loss"] == pytest.approx(tested, rel=1e-6), name
    for name in ("ddp resumed", "fsdp resumed"):  # their best: the step-6 checkpoint they saved
        assert runs[name].val_losses() == pytest.approx({5: validated[5]}, rel=1e-6), name
    assert runs["fsdp resumed"].summary["metrics"]["test_loss"] == pytest.approx(
        runs["ddp resumed"].summary["metrics"]["test_loss"], rel=1e-6)
    assert runs["ddp resumed"].summary["metrics"]["test_loss"] != pytest.approx(tested)


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "callback", "why"), [
    ("ld_fsdp", "swa", "ld_fsdp shards the weights, which its copy cannot take (FSDP2's DTensors): Lightning's"
                       " WeightAveraging (whose default average is SWA's) or EMAWeightAveraging keep their copy sharded"
                       " under ld_fsdp"),
    ("ld_fsdp_pp", "ema", "ld_fsdp splits the model into pipeline stages, whose saves it does not lay out: average the"
                          " weights without pipeline stages"),
    ("ld_deepspeed_stage_3", "ema", "ld_deepspeed partitions the weights, which the copy cannot take (ZeRO-3's module"
                                    " holds empty placeholders): average the weights under ZeRO-1/2, ld_fsdp or"
                                    " ld_ddp"),
])
def test_an_engine_that_cannot_keep_the_copy_stops_before_any_rank_starts(tmp_path, strategy, callback, why):
    process = _run(tmp_path, strategy, callback)
    assert process.returncode == 1
    name = "EMAWeightAveraging" if callback == "ema" else "StochasticWeightAveraging"
    assert f"{name} keeps a copy of the model's weights and saves it as the checkpoint's state_dict, and {why}" in (
        process.stderr)
    assert "Initializing distributed" not in process.stdout + process.stderr  # no rank started
    assert not list(tmp_path.glob("*.ckpt"))


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(2))
        self.embed = nn.Embedding(4, 2)
        self.head = nn.Linear(2, 4, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("table", torch.arange(3.0), persistent=False)


def test_the_copy_pairs_with_the_model_by_order_and_saves_under_the_model_s_names():
    model = _Tied()
    copy = _copy_of(model, None)
    own, copied = list(model.parameters()) + list(model.buffers()), list(copy.parameters()) + list(copy.buffers())
    assert len(own) == len(copied) == 4  # the tied weight once, as the model lists it
    assert all(a is not b and torch.equal(a, b) for a, b in zip(own, copied))
    assert list(copy.state_dict()) == list(model.state_dict())  # both names of the tied weight; not the table
    assert copy.head.weight is copy.embed.weight


def test_a_callback_whose_fit_setup_was_not_taken_over_stops_in_one_line():
    from lightning.pytorch.callbacks import EMAWeightAveraging

    averages = ShardedAverages()
    averages.take_over(type("Trainer", (), {"callbacks": [EMAWeightAveraging()]})())
    with pytest.raises(RuntimeError, match="^EMAWeightAveraging: its setup for the fit did not run as lightning-dist"
                                           " took it over"):
        averages.build(_Tied())


def test_a_deepspeed_checkpoint_keeps_the_average_beside_the_engine_s_weights_and_loads_it_back():
    """ZeRO-1/2 (strategies/deepspeed/average.py): the engine saves its module, and Lightning's DeepSpeed strategy
    leaves `state_dict` (where the callback put the average) out of its client state. Saved under its own key,
    without the frozen weights a save leaves out; loaded back as Lightning lays it out, those weights the model's,
    and, outside a fit, the average in the model (what a test runs)."""
    from lightning_dist.checkpoints.formats import AVERAGE_STATE_DICT, AVERAGING_STATE, CURRENT_MODEL_STATE
    from lightning_dist.strategies.deepspeed.average import average_into_client_state, average_out_of_client_state

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    model[0].requires_grad_(False)
    average = {name: value + 1 for name, value in model.state_dict().items()}
    checkpoint = {"state_dict": average, CURRENT_MODEL_STATE: model.state_dict(), AVERAGING_STATE: {"n_averaged": 3},
                  "epoch": 0}
    saved = average_into_client_state(checkpoint, left_out={"0.weight", "0.bias"})
    assert sorted(saved) == sorted([AVERAGE_STATE_DICT, AVERAGING_STATE, "epoch", "state_dict"])
    assert sorted(saved[AVERAGE_STATE_DICT]) == ["1.bias", "1.weight"]
    assert average_into_client_state({"state_dict": average}, set()) == {"state_dict": average}  # no average: as is
    engine_saves = {key: value for key, value in saved.items() if key != "state_dict"}  # as Lightning leaves it out
    current = {name: value.clone() for name, value in model.state_dict().items()}
    loaded = average_out_of_client_state(model, engine_saves)
    assert AVERAGE_STATE_DICT not in loaded and loaded[AVERAGING_STATE] == {"n_averaged": 3}
    assert sorted(loaded["state_dict"]) == sorted(current)
    for name, value in loaded["state_dict"].items():  # the frozen ones the model's (never averaged off them)
        assert torch.equal(value, current[name] if name.startswith("0.") else average[name]), name
    for name, value in loaded[CURRENT_MODEL_STATE].items():
        assert torch.equal(value, current[name]), name
    for name, value in model.state_dict().items():  # no Trainer fitting it: the average, as a test runs it
        assert torch.equal(value, loaded["state_dict"][name]), name
