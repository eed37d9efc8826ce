import math

import torch

from lightning_dist.models.gpt import GPT, GPTLanguageModel


def test_output_head_is_tied_to_token_embedding():
    gpt = GPT(vocab_size=256, block_size=16, n_layer=2, n_head=2, d_model=32, dropout=0.0)
    assert gpt.lm_head.weight is gpt.token_embedding.weight
    assert gpt(torch.randint(0, 256, (3, 16))).shape == (3, 16, 256)


def test_initial_loss_is_near_uniform_over_bytes():
    torch.manual_seed(0)
    model = GPTLanguageModel(n_layer=2, d_model=64)
    batch = (torch.randint(0, 256, (4, 128)), torch.randint(0, 256, (4, 128)))
    loss = model.training_step(batch, 0)
    assert abs(loss.item() - math.log(256)) < 0.3


def test_weight_decay_skips_biases_and_norms():
    model = GPTLanguageModel(n_layer=1, d_model=32, n_head=2)
    decay, no_decay = model.configure_optimizers().param_groups
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == sum(p.numel() for p in model.parameters())


def test_unknown_optimizer_is_refused_with_the_choices():
    import pytest

    with pytest.raises(ValueError, match=r"^model.optimizer: 'adam' is not supported; choose one of adamw, sgd$"):
        GPTLanguageModel(optimizer="adam")
    assert type(GPTLanguageModel(optimizer="sgd", n_layer=1).configure_optimizers()) is torch.optim.SGD
