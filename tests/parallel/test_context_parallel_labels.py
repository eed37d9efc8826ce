"""Context parallelism and a transformers model called with `labels=`: its causal-LM loss becomes the shard's share
of the whole sequence's, and what cannot become one stops in one line (in process, one rank; the two-rank losses
are tests/models/test_finetune_runs.py's)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from lightning_dist.parallel.context_parallel import ContextParallel
from tests.conftest import one_rank_world

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=2)
LLAMA = LlamaConfig(**SHAPE)


@pytest.fixture(scope="module")
def context():
    with one_rank_world():
        context = ContextParallel(group=dist.group.WORLD, rank=0, size=1)
        context.model_name = "Model"
        yield context


def test_a_causal_lm_s_loss_is_computed_through_the_sequence_s_labels(context):
    torch.manual_seed(0)
    model, ids = LlamaForCausalLM(LLAMA), torch.randint(0, 64, (2, 8))
    labels = ids.clone()
    labels[0, 3] = -100  # an ignored label: the count of labels is the group's, not the shard's length
    expected = model(input_ids=ids, labels=labels).loss
    with context.sequence_losses(model):
        loss = model(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    assert context._losses == 1
    assert "_loss_function" not in model.__dict__  # the model's own loss again after the step


def test_the_next_labels_of_one_shard_are_its_own_shifted():
    context = ContextParallel(group=None, rank=0, size=1)
    context.held_positions = lambda positions: positions  # as one rank holds them

    def gather(out, tensor, group=None):
        out[0].copy_(tensor)

    labels = torch.tensor([[5, 6, 7, 8]])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dist, "all_gather", gather)
        assert context.next_labels(labels, -100).tolist() == [[6, 7, 8, -100]]


def test_the_next_labels_come_from_the_shard_after_this_one():
    """Rank 0 of 2: its last token's next label is the first of rank 1's shard."""
    context = ContextParallel(group=None, rank=0, size=2)
    shards = [torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5, 6]])]

    def gather(out, tensor, group=None):
        if tensor.dim() == 2:  # the labels
            for slot, shard in zip(out, shards):
                slot.copy_(shard)
        else:  # the positions each rank holds
            for rank, slot in enumerate(out):
                slot.copy_(torch.arange(3) + 3 * rank)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dist, "all_gather", gather)
        assert context.next_labels(shards[0], -100).tolist() == [[2, 3, 4]]
        context.rank = 1
        assert context.next_labels(shards[1], -100).tolist() == [[5, 6, -100]]


class OwnLoss(LlamaForCausalLM):
    """A model that computes its loss itself from `labels=`, as custom models do."""

    def forward(self, input_ids, labels=None):
        logits = super().forward(input_ids=input_ids).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def test_a_loss_computed_without_the_models_loss_function_stops_the_step(context):
    model = OwnLoss(LLAMA)
    with pytest.raises(ValueError) as refused, context.sequence_losses(model):
        model(torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long))
    assert str(refused.value) == (
        "strategy.context_parallel_size=1: OwnLoss was called with labels= but computed its loss without its"
        " loss_function, so the loss would be over this rank's shard only; compute the loss in the step from the"
        " logits, with the targets in the batch")


def test_another_loss_type_a_loss_without_loss_function_and_a_callers_item_count_stop_the_step(context):
    ids = torch.zeros(1, 4, dtype=torch.long)
    classifier = LlamaForSequenceClassification(LlamaConfig(**SHAPE, num_labels=2, pad_token_id=0))
    with pytest.raises(ValueError, match=r"^strategy.context_parallel_size=1: Model's loss from labels="
                                         r" \(ForSequenceClassification\) would be over this rank's shard"):
        with context.sequence_losses(classifier):
            classifier(input_ids=ids, labels=torch.tensor([1]))
    # BERT's masked LM computes its loss itself (CrossEntropyLoss), not through loss_function.
    bert = BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=64))
    with pytest.raises(ValueError, match=r"^strategy.context_parallel_size=1: BertForMaskedLM was called with"
                                         r" labels= but computed its loss without its loss_function"):
        with context.sequence_losses(bert):
            bert(input_ids=ids, labels=ids)
    llama = LlamaForCausalLM(LLAMA)
    with pytest.raises(ValueError, match=r"^strategy.context_parallel_size=1: leave num_items_in_batch out"):
        with context.sequence_losses(llama):
            llama(input_ids=ids, labels=ids, num_items_in_batch=4)
