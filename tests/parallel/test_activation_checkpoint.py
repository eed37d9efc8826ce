import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from lightning_dist.models.gpt import GPT, TransformerBlock
from lightning_dist.parallel import apply_activation_checkpointing


def tiny_gpt(n_layer: int = 3) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=32, block_size=8, n_layer=n_layer, n_head=2, d_model=16, dropout=0.0)


def test_one_wrapper_per_block_even_when_applied_twice():
    model = tiny_gpt(n_layer=3)
    assert apply_activation_checkpointing(model, (TransformerBlock,)) == 3
    assert apply_activation_checkpointing(model, (TransformerBlock,)) == 3  # fit, then test: set-up runs again
    wrappers = [m for m in model.modules() if isinstance(m, CheckpointWrapper)]
    assert len(wrappers) == 3
    assert all(not isinstance(m, CheckpointWrapper) for w in wrappers for m in w._checkpoint_wrapped_module.modules())


def test_blocks_are_recomputed_in_backward_with_identical_gradients(block_forwards):
    tokens = torch.randint(0, 32, (2, 8))
    plain, checkpointed = tiny_gpt(), tiny_gpt()
    apply_activation_checkpointing(checkpointed, (TransformerBlock,))

    plain(tokens).sum().backward()
    assert block_forwards[0] == 3  # forward only
    checkpointed(tokens).sum().backward()
    assert block_forwards[0] == 3 + 6  # forward, then each block again during backward
    for (name, p), (_, q) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
