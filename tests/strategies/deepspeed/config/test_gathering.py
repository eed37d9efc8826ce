"""ZeRO-3 presets keep two blocks gathered, not DeepSpeed's 1e9 elements (the whole of any smaller model)."""

from __future__ import annotations

import torch

from lightning_dist.models.gpt import GPTLanguageModel
from lightning_dist.strategies.deepspeed.config.gathering import gathering_sized_by_model, largest_block


def _gpt() -> GPTLanguageModel:
    with torch.device("meta"):
        return GPTLanguageModel(d_model=256, n_layer=3, n_head=4, block_size=32)


def test_live_parameters_and_reuse_distance_follow_the_largest_block():
    model = _gpt()
    block = sum(p.numel() for p in model.model.blocks[0].parameters())
    assert block == 12 * 256 * 256 + 13 * 256  # four matrices, their biases, two LayerNorms
    assert largest_block(model) == block
    config = {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9}}
    zero = gathering_sized_by_model(config, model)["zero_optimization"]
    assert (zero["stage3_max_live_parameters"], zero["stage3_max_reuse_distance"]) == (2 * block, block)
    assert config["zero_optimization"]["stage3_max_live_parameters"] == 1e9  # the caller's config is not modified


def test_other_stages_and_models_without_repeated_blocks_keep_deepspeeds_values():
    config = {"zero_optimization": {"stage": 2}}
    assert gathering_sized_by_model(config, _gpt()) is config
    flat = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    config = {"zero_optimization": {"stage": 3}}
    assert gathering_sized_by_model(config, flat) is config
