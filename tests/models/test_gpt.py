import math
from functools import partial

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


def test_weight_decay_skips_biases_norms_and_the_tied_embedding():
    model = GPTLanguageModel(n_layer=1, d_model=32, n_head=2)
    decay, no_decay = model.configure_optimizers().param_groups
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    decayed = {id(p) for p in decay["params"]}
    names = [name for name, p in model.named_parameters() if id(p) in decayed]
    assert names == ["model.blocks.0.attn.q.weight", "model.blocks.0.attn.k.weight", "model.blocks.0.attn.v.weight",
                     "model.blocks.0.attn.proj.weight", "model.blocks.0.mlp.0.weight",
                     "model.blocks.0.mlp.2.weight"]  # not the (tied) token embedding, the position embedding, norms, biases
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == sum(p.numel() for p in model.parameters())


def test_the_optimizer_factory_builds_the_optimizer():
    sgd = GPTLanguageModel(optimizer=partial(torch.optim.SGD, lr=0.1, momentum=0.9), n_layer=1).configure_optimizers()
    assert type(sgd) is torch.optim.SGD and sgd.defaults["momentum"] == 0.9
    assert "optimizer" not in GPTLanguageModel(optimizer=partial(torch.optim.SGD, lr=0.1), n_layer=1).hparams
