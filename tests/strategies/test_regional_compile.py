"""`compile=true`: each block of the model compiled on its own (regional torch.compile) under DDP, FSDP with
activation checkpointing (plain FSDP's path with the checkpoint wrapper around each compiled block) and ZeRO-3 (its
parameters gathered by hooks around every compiled block). The compiled runs train the eager runs' losses, their
checkpoints carry the eager model's keys, an eager checkpoint resumes compiled and a compiled one eager, and the
console says when compilation happens and how long it takes."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from lightning_dist.models.gpt import GPT, TransformerBlock
from lightning_dist.parallel import apply_activation_checkpointing, block_classes_for
from lightning_dist.parallel.regional_compile import compile_blocks
from lightning_dist.reports.equivalence import run_strategy
from tests.conftest import CURVE_OVERRIDES, in_the_suite

COMPILED = ["ddp", "fsdp_activation_checkpointing", "deepspeed_stage_3"]
# Inductor fuses the elementwise ops and reorders some reductions: losses moved by at most 1.5e-7 relative over 30
# steps (measured for all five); 1e-4 is the bound the feature promises, and a block left out of the optimizer, a
# parameter compiled as a constant or a lost gradient hook moves them by more than 1e-3.
RELATIVE_TOLERANCE = 1e-4
# Weights after 15 resumed steps against the uninterrupted run's: the same rounding differences. The attention keys'
# biases are where they show most (5e-6 measured): a key bias shifts every score of a row alike, which the softmax
# ignores, so its gradient is rounding noise that Adam scales up to steps of the learning rate's size. A checkpoint
# not loaded, or loaded into other names, leaves weights 15 steps apart (>1e-3).
WEIGHT_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


def small_gpt() -> GPT:
    return GPT(vocab_size=64, block_size=16, n_layer=3, n_head=2, d_model=32, dropout=0.0)


@pytest.mark.parametrize("checkpointed", [False, True], ids=["blocks", "checkpointed blocks"])
def test_each_block_is_compiled_in_place_once_and_keeps_its_names(checkpointed):
    model = small_gpt()
    if checkpointed:
        apply_activation_checkpointing(model, (TransformerBlock,))
    names = list(model.state_dict())
    assert compile_blocks(model, (TransformerBlock,)) == 3
    runners = [model.blocks[i] for i in range(3)]  # the checkpoint wrapper where there is one: it runs the block
    assert all(getattr(r, "_compiled_call_impl", None) is not None for r in runners)
    assert not any(getattr(m, "_compiled_call_impl", None) for m in model.modules() if m not in runners)
    compiled_calls = [r._compiled_call_impl for r in runners]
    assert compile_blocks(model, (TransformerBlock,)) == 3  # Lightning sets up again for `test` after `fit`
    assert [r._compiled_call_impl for r in runners] == compiled_calls
    assert list(model.state_dict()) == names  # no `_orig_mod.`: checkpoints keep the eager model's keys


def test_a_model_without_blocks_is_refused_naming_the_key_and_its_classes():
    with pytest.raises(ValueError) as error:
        block_classes_for(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), (), ["compile"])
    assert str(error.value) == ("strategy.block_class: compile needs the block class and the model has no nn.ModuleList"
                                " to infer it from; set it to one of: Linear, ReLU, Sequential")


@pytest.fixture(scope="module")
def compiled_runs(tmp_path_factory):
    """{preset: the 30-step curve run with compile=true}, each made once (the eager ones are `curve_runs`)."""
    runs = {}

    def get(name: str):
        if name not in runs:
            runs[name] = run_strategy(name, [*CURVE_OVERRIDES, "compile=true"], tmp_path_factory.mktemp(name) / "run")
        return runs[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", in_the_suite(COMPILED, ["ddp"]))
def test_compiled_blocks_train_the_eager_losses_and_say_when_they_compile(name, compiled_runs, curve_runs):
    compiled, eager = compiled_runs(name), curve_runs(name)
    assert compiled.returncode == 0, compiled.output[-3000:]
    assert sorted(compiled.losses) == list(range(30))
    assert compiled.max_relative_difference(eager) <= RELATIVE_TOLERANCE
    log = (compiled.run_dir / "train.log").read_text()
    assert "torch.compile: 4 blocks (TransformerBlock) compile on their first forward and backward" in log
    # Said at the next step, the graphs compiled since together (ZeRO-3's hooks split a block into dozens): the
    # sanity check's evaluation graph, then the training step's.
    reports = re.findall(r"torch\.compile: compiled (\d+) graphs? in \d+\.\d s", log)
    assert len(reports) >= 2 and all(int(graphs) >= 1 for graphs in reports), log[-3000:]
    assert "torch.compile" not in (eager.run_dir / "train.log").read_text()  # off unless asked for


@pytest.mark.slow
def test_a_compiled_checkpoint_has_the_eager_models_keys(compiled_runs, curve_runs):
    compiled, eager = (torch.load(run.run_dir / "checkpoints" / "step000015.ckpt", weights_only=True)["state_dict"]
                       for run in (compiled_runs("ddp"), curve_runs("ddp")))
    assert list(compiled) == list(eager)
    assert not any("_orig_mod" in key for key in compiled)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "direction"), in_the_suite([("ddp", "eager to compiled"),
                                                             ("deepspeed_stage_3", "compiled to eager")],
                                                            [("ddp", "eager to compiled")], unpack=True))
def test_a_checkpoint_resumes_across_compilation_with_the_uninterrupted_weights(name, direction, compiled_runs,
                                                                                 curve_runs, tmp_path):
    eager_source = direction == "eager to compiled"
    source, resumed_as = (curve_runs(name), ["compile=true"]) if eager_source else (compiled_runs(name), [])
    checkpoint = source.run_dir / "checkpoints" / "step000015.ckpt"
    resumed = run_strategy(name, [*CURVE_OVERRIDES, *resumed_as, f"ckpt_path={checkpoint}"], tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert sorted(resumed.losses) == list(range(15, 30))
    final = torch.load(resumed.run_dir / "gathered_state.pt")
    uninterrupted = torch.load(source.run_dir / "gathered_state.pt")
    assert set(final) == set(uninterrupted)
    for key, tensor in uninterrupted.items():
        torch.testing.assert_close(final[key], tensor, **WEIGHT_TOLERANCE, msg=key)
