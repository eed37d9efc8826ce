"""`save_adapters` (checkpoints/adapters.py) in one process: what it writes is every weight of the adapter, whatever
wraps the model's layers, or nothing and one line. PEFT picks an adapter's entries by its tuner layers' names:
under activation checkpointing (torch's wrapper in every block's names) it wrote an empty `adapter_model.safetensors`
on every run of fsdp_activation_checkpointing and ZeRO-3's, which the two-rank runs of tests/models found later."""

from __future__ import annotations

import pytest
import torch

import lightning_dist
from tests.tiny_llama import tiny_llama


def _adapted():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(tiny_llama(), LoraConfig(r=2, target_modules="all-linear", init_lora_weights=False))
    return model, {name.replace(".default.", "."): value.detach().clone() for name, value in model.named_parameters()
                   if "lora_" in name}


def test_the_adapters_of_checkpointed_blocks_are_written_whole(tmp_path):
    from safetensors.torch import load_file
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model, adapters = _adapted()
    apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, LlamaDecoderLayer))
    assert any("_checkpoint_wrapped_module" in name for name, _ in model.named_parameters())
    lightning_dist.save_adapters(model, tmp_path / "adapters")
    written = load_file(tmp_path / "adapters" / "adapter_model.safetensors")
    assert sorted(written) == sorted(adapters) and len(written) == 28
    for name, value in adapters.items():
        assert torch.equal(written[name], value), name


def test_an_adapter_peft_would_write_in_part_is_refused_in_one_line(tmp_path):
    """Another adapter named as a module of the model (`mlp`): PEFT drops every entry with that segment from the
    adapter it writes (PEFT #3584), silently."""
    from peft import LoraConfig

    model, _ = _adapted()
    model.add_adapter("mlp", LoraConfig(r=2, target_modules="all-linear"))
    with pytest.raises(RuntimeError) as refused:
        lightning_dist.save_adapters(model, tmp_path / "adapters")
    assert str(refused.value) == (
        "save_adapters: PEFT picked 16 of the 28 weights of adapter 'default'"
        " (base_model.model.model.layers.0.mlp.down_proj.lora_A.default.weight not among them): nothing written")
    assert not (tmp_path / "adapters").exists()
