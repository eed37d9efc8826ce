"""`lightning_dist.save_pretrained` in one process: what it refuses, and what it writes for a PEFT model. Under every
strategy, after fit: tests/models/test_stages_around_fit.py. transformers' and PEFT's own `save_pretrained` on a model
whose weights FSDP2 shards stops in one line naming ours (it stopped in safetensors on the rank that called it:
"Attempted to access the data pointer on an invalid python storage")."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import lightning_dist
from lightning_dist.checkpoints.save_pretrained import refuse_own_save_pretrained
from tests.conftest import REPO, TRAIN_ENV

REFUSED = ("save_pretrained: ld_fsdp holds the weights sharded over the ranks; call lightning_dist.save_pretrained(model,"
           " folder) on every rank, which gathers them (dtype=torch.bfloat16 writes them in bf16)")


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))


def test_a_folder_that_holds_anything_is_refused_and_left_as_it_is(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=f"save_pretrained: {tmp_path} is not empty; pass a new folder"):
        lightning_dist.save_pretrained(tiny_llama(), tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_a_module_that_is_not_a_transformers_model_is_refused_naming_what_to_pass(tmp_path):
    with pytest.raises(TypeError, match=r"save_pretrained: Linear is not a transformers model; pass the one your"):
        lightning_dist.save_pretrained(torch.nn.Linear(2, 2), tmp_path / "out")


def test_a_peft_model_writes_its_adapters_as_peft_does(tmp_path):
    model = get_peft_model(tiny_llama(), LoraConfig(r=2, target_modules=["q_proj"]))
    lightning_dist.save_pretrained(model, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "README.md", "adapter_config.json", "adapter_model.safetensors"]


def test_the_weights_round_trip_in_the_dtype_asked(tmp_path):
    model = tiny_llama()
    lightning_dist.save_pretrained(model, tmp_path / "out", dtype=torch.bfloat16)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "out")
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value.to(torch.bfloat16)), name


def test_transformers_own_save_pretrained_of_a_sharded_model_stops_and_ours_still_writes(tmp_path):
    model = tiny_llama()
    refuse_own_save_pretrained(model, "ld_fsdp")
    with pytest.raises(RuntimeError, match=f"^LlamaForCausalLM.{REFUSED.replace('(', '[(]').replace(')', '[)]')}$"):
        model.save_pretrained(tmp_path / "theirs")
    assert not (tmp_path / "theirs").exists()
    lightning_dist.save_pretrained(model, tmp_path / "ours")  # it gives transformers the gathered weights
    assert LlamaForCausalLM.from_pretrained(tmp_path / "ours").model.norm.weight.shape == (16,)


def test_peft_s_own_save_pretrained_of_a_sharded_model_stops_and_ours_still_writes(tmp_path):
    model = get_peft_model(tiny_llama(), LoraConfig(r=2, target_modules=["q_proj"]))
    refuse_own_save_pretrained(model, "ld_fsdp")
    with pytest.raises(RuntimeError, match="^PeftModel.save_pretrained: ld_fsdp holds the weights sharded"):
        model.save_pretrained(tmp_path / "theirs")
    lightning_dist.save_pretrained(model, tmp_path / "ours")
    assert (tmp_path / "ours" / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_rank_0_s_own_save_pretrained_after_an_fsdp_fit_stops_in_one_line(tmp_path):
    process = subprocess.run([sys.executable, str(REPO / "tests" / "save_after_test_script.py"), str(tmp_path),
                              "ld_fsdp", "fit,hf"], cwd=REPO, env={**TRAIN_ENV, "PYTHONPATH": str(REPO)},
                             capture_output=True, text=True, timeout=300)
    assert process.returncode == 1
    assert f"RuntimeError: LlamaForCausalLM.{REFUSED}" in process.stderr
    assert "invalid python storage" not in process.stderr
    assert not (tmp_path / "fine-tuned").exists()
