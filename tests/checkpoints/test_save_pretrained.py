"""`lightning_dist.save_pretrained` in one process: what it refuses, and what it writes for a PEFT model. Under every
strategy, after fit: tests/models/test_stages_around_fit.py."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import lightning_dist


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
