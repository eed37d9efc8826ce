"""Context parallelism exchanges every attention call or stops: calls of `F.scaled_dot_product_attention` under
any name are seen in forward and counted against the model's blocks (in process: the exchange is recorded, with no
group)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from lightning_dist.parallel.context_parallel import ContextParallel, positions_refusal
from tests.parallel.attention_variants import Stack


def recording_context(exchanged: list) -> ContextParallel:
    def exchange(query, key, value, attend):
        exchanged.append(query.shape)
        return attend(query, key, value)

    context = ContextParallel(group=None, rank=0, size=1, exchange=exchange)
    context.attention_layers, context.model_name = 3, "Stack"
    return context


@pytest.mark.parametrize("how", ["by name", "aliased"])
def test_every_call_of_sdpa_is_exchanged_whatever_its_name(how):
    exchanged: list = []
    context = recording_context(exchanged)
    model, x = Stack(how), torch.randn(2, 8, 16)
    expected = model(x)
    with context.counted_forward(), context.attention():
        output = model(x)
    assert len(exchanged) == 3 and exchanged[0] == (2, 2, 8, 8)
    assert context.exchanges == ({"by name": 3, "aliased": 0} if how == "by name" else {"by name": 0, "aliased": 3})
    torch.testing.assert_close(output, expected, rtol=0, atol=0)  # the exchange ran the model's own attention


def test_attention_written_out_stops_the_step_in_one_line():
    context = recording_context([])
    with pytest.raises(ValueError) as refused:
        with context.counted_forward(), context.attention():
            Stack("written out")(torch.randn(2, 8, 16))
    assert str(refused.value) == (
        "strategy.context_parallel_size=1: Stack's forward called torch.nn.functional.scaled_dot_product_attention 0"
        " times for its 3 blocks, so the rest of its attention (written out, or another kernel) saw only this"
        " rank's shard of the sequence; make every attention layer call scaled_dot_product_attention"
        ' (transformers: attn_implementation="sdpa")')


def test_checkpointed_blocks_recompute_by_name_calls_exchanged_and_refuse_aliased_ones():
    exchanged: list = []
    context = recording_context(exchanged)
    context.recomputes = True
    model, x = Stack("by name"), torch.randn(2, 8, 16, requires_grad=True)
    with context.counted_forward(), context.attention():
        loss = sum(checkpoint(block, x, use_reentrant=False).sum() for block in model.blocks)
    with context.attention():  # as the context-parallel axis enters it around backward
        loss.backward()
    assert len(exchanged) == 6  # 3 in forward, 3 again in backward's recomputation
    with pytest.raises(ValueError, match=r"^strategy.context_parallel_size=1: Stack calls"
                                         r" scaled_dot_product_attention under another name, which is exchanged in"
                                         r" forward but not when activation checkpointing runs the blocks again"):
        with context.counted_forward(), context.attention():
            Stack("aliased")(x)


class Positioned(torch.nn.Module):
    """A `wpe` position embedding, used, or left aside for positions computed inline (sinusoids, as some models
    write them)."""

    def __init__(self, uses_its_embedding: bool) -> None:
        super().__init__()
        self.uses_its_embedding = uses_its_embedding
        self.wpe, self.stack = torch.nn.Embedding(8, 16), Stack("by name")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1])
        if self.uses_its_embedding:
            return self.stack(x + self.wpe(positions))
        return self.stack(x + torch.sin(positions[:, None] / 10.0 ** (torch.arange(16) / 16)))


def test_positions_computed_without_the_found_position_module_stop_the_step_in_one_line():
    """The shard's positions are shifted where the model calls its position module (found by name): a model that
    never calls it gave every shard the sequence's first positions, with no word."""
    context, x = recording_context([]), torch.randn(2, 8, 16)
    with context.positions_shifted(model := Positioned(True)), context.counted_forward(), context.attention():
        model(x)
    with pytest.raises(ValueError) as refused:
        with context.positions_shifted(model := Positioned(False)), context.counted_forward(), context.attention():
            model(x)
    assert str(refused.value) == (
        "strategy.context_parallel_size=1: Positioned's forward never called wpe, the position module it was found to"
        " have, so this shard's positions were those of the sequence's start; compute the positions by calling that"
        " module (an nn.Embedding named position_embedding, wpe or embed_positions, or a ...RotaryEmbedding given"
        " position_ids)")


def test_opt_s_learned_positions_are_shifted_where_it_takes_them_as_position_ids():
    """OPT's position embedding is called with the attention mask first and the positions as `position_ids=`:
    shifting its first argument left the second shard at the sequence's first positions (2 ranks trained 1.5e-3 off
    one rank's loss at step 0, without a word)."""
    from transformers import OPTConfig, OPTForCausalLM
    from transformers.models.opt.modeling_opt import OPTLearnedPositionalEmbedding

    model = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=16, ffn_dim=32, num_hidden_layers=1,
                                     num_attention_heads=2, word_embed_proj_dim=16, max_position_embeddings=8))
    embedded: list[torch.Tensor] = []
    model.model.decoder.embed_positions.register_forward_hook(lambda module, args, output: embedded.append(output))
    tokens = torch.randint(64, (1, 8))
    model(input_ids=tokens)
    second_shard = ContextParallel(group=None, rank=1, size=2)
    with second_shard.positions_shifted(model):
        model(input_ids=tokens[:, 4:])
    torch.testing.assert_close(embedded[1], embedded[0][:, 4:], rtol=0, atol=0)

    class CountsItsOwn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_positions = OPTLearnedPositionalEmbedding(8, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.embed_positions(torch.ones(x.shape[:2], dtype=torch.long))

    with pytest.raises(ValueError) as refused:
        with second_shard.positions_shifted(module := CountsItsOwn()):
            module(torch.randn(1, 4, 16))
    assert str(refused.value) == (
        "strategy.context_parallel_size=2: embed_positions was called without its position_ids, so it would count this"
        " shard's positions from the sequence's start; pass them")


def test_a_position_module_that_takes_its_positions_in_an_argument_of_another_name_is_refused():
    class Indexed(torch.nn.Embedding):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wpe = Indexed(8, 16)

    assert positions_refusal(Model(), 2) == (
        "strategy.context_parallel_size=2: wpe (Indexed) takes no argument named position_ids or input, so this"
        " shard's positions cannot be given to it")
    assert positions_refusal(Positioned(True), 2) is None
