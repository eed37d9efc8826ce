"""Activation checkpointing of every block, of every k-th block, and op-level (matrix products and attention kept):
the same gradients, and recomputation of exactly what each form gives up."""

from collections import Counter

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_dist.models.gpt import GPT, TransformerBlock
from lightning_dist.parallel import apply_activation_checkpointing
from lightning_dist.parallel.activation_checkpoint import CheckpointPlan


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


def test_every_kth_block_is_checkpointed_and_only_those_are_recomputed(block_forwards):
    tokens = torch.randint(0, 32, (2, 8))
    plain, checkpointed = tiny_gpt(n_layer=4), tiny_gpt(n_layer=4)
    assert apply_activation_checkpointing(checkpointed, (TransformerBlock,), CheckpointPlan(every=2)) == 2
    assert [isinstance(block, CheckpointWrapper) for block in checkpointed.blocks] == [False, True, False, True]
    plain(tokens).sum().backward()
    checkpointed(tokens).sum().backward()
    assert block_forwards[0] == 4 + 4 + 2  # the second and fourth blocks run again in backward
    for (name, p), (_, q) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


class OpCounts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def ops_run(plan: CheckpointPlan | None) -> tuple[Counter, list[torch.Tensor]]:
    model = tiny_gpt()
    if plan is not None:
        apply_activation_checkpointing(model, (TransformerBlock,), plan)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    with OpCounts() as counter:
        model(tokens).sum().backward()
    return counter.counts, [p.grad for p in model.parameters()]


def test_op_level_checkpointing_keeps_the_products_and_recomputes_the_cheap_ops(monkeypatch):
    # A ZeRO-3 run earlier in this process leaves its own linear in place of torch's, as DeepSpeed does: count torch's.
    monkeypatch.setattr(torch.nn.functional, "linear", torch._C._nn.linear)
    (plain, plain_grads), (full, _), (ops, ops_grads) = (ops_run(p) for p in (None, CheckpointPlan(), CheckpointPlan(ops=True)))
    # Whole blocks again: q, k, v, the attention's projection and the MLP's first layer (the recomputation stops at
    # the last tensor backward needs, before the MLP's second layer), and attention itself.
    assert full["addmm"] == plain["addmm"] + 3 * 5
    sdpa = "_scaled_dot_product_flash_attention_for_cpu"
    assert full[sdpa] == plain[sdpa] + 3
    assert ops["addmm"] == plain["addmm"] and ops[sdpa] == plain[sdpa]  # kept: not one product nor attention redone
    assert ops["native_layer_norm"] == full["native_layer_norm"] == plain["native_layer_norm"] + 3 * 2  # recomputed
    assert ops["gelu"] == plain["gelu"] + 3
    for plain_grad, ops_grad in zip(plain_grads, ops_grads):
        torch.testing.assert_close(ops_grad, plain_grad, rtol=0, atol=0)


@pytest.mark.parametrize("value, plan", [
    (False, None), (None, None), ("none", None), (True, CheckpointPlan()), ("full", CheckpointPlan()),
    (1, CheckpointPlan()), ("ops", CheckpointPlan(ops=True)), (3, CheckpointPlan(every=3)),
])
def test_the_option_reads_as_a_plan(value, plan):
    assert CheckpointPlan.of(value) == plan


@pytest.mark.parametrize("value", ["sometimes", 0, -2, 1.5])
def test_another_value_is_refused_naming_the_key_and_the_choices(value):
    with pytest.raises(ValueError) as error:
        CheckpointPlan.of(value)
    assert str(error.value) == (f"strategy.activation_checkpointing={value!r}: must be false, true (every block), ops (every"
                                " block, keeping matrix products and attention), or an integer k >= 1 (every k-th block)")
