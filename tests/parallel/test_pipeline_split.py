"""Splitting a model into pipeline stages, in one process: which blocks each stage runs, what each rank keeps (by
the whole model's names), what a model must have to be split, and that the stages run in a row compute the model's
own forward."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_dist.models.gpt import GPTLanguageModel, TransformerBlock
from lightning_dist.parallel.pipeline_layout import PipelineLayout, check_pipeline
from lightning_dist.parallel.pipeline_split import PipelineSplit, StageView, find_trunk, prune_to_stages

KEY = "strategy.pipeline_parallel_size"


def gpt(n_layer: int = 4) -> GPTLanguageModel:
    torch.manual_seed(0)
    return GPTLanguageModel(n_layer=n_layer, d_model=32, n_head=2, block_size=16)


def test_loop_and_v_layouts_place_stages_and_blocks_as_torch_does():
    looped = PipelineLayout(pp=2, stages_per_rank=2, blocks=8, schedule="Interleaved1F1B")
    assert [looped.stages_of_rank(rank) for rank in range(2)] == [[0, 2], [1, 3]]
    v_shape = PipelineLayout(pp=2, stages_per_rank=2, blocks=8, schedule="ZBVZeroBubble")
    assert [v_shape.stages_of_rank(rank) for rank in range(2)] == [[0, 3], [1, 2]]
    assert [list(v_shape.blocks_of_stage(stage)) for stage in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert v_shape.rank_of_stage(3) == 0


def test_the_bubble_and_the_microbatches_in_flight_follow_the_schedule():
    assert PipelineLayout(4, 1, 8, "GPipe").bubble_fraction(8) == pytest.approx(3 / 11)
    assert PipelineLayout(4, 2, 8, "Interleaved1F1B").bubble_fraction(8) == pytest.approx(1.5 / 9.5)
    assert PipelineLayout(4, 2, 8, "ZBVZeroBubble").bubble_fraction(8) == 0
    assert PipelineLayout(4, 1, 8, "GPipe").in_flight(8, 0) == 8
    assert [PipelineLayout(4, 1, 8, "1F1B").in_flight(8, stage) for stage in range(4)] == [4, 3, 2, 1]


@pytest.mark.parametrize(("arguments", "message"), [
    ((2, 1, "1f1b", 2, 4, 8), None),  # any case
    ((2, 1, "Zbv", 2, 4, 8), "strategy.pipeline_schedule='Zbv': choose one of GPipe, 1F1B,"),
    ((3, 1, "GPipe", 3, 4, 6), "strategy.pipeline_parallel_size=3: the model's 4 blocks do not divide into 3 stages"),
    ((2, 1, "DualPipeV", 4, 4, 8), "strategy.stages_per_rank=1: DualPipeV runs exactly 2 stage(s) per rank"),
    ((2, 2, "DualPipeV", 3, 4, 6), "strategy.microbatches=3: DualPipeV needs at least one per stage, here 4"),
    ((2, 2, "Interleaved1F1B", 5, 4, 10), "strategy.microbatches=5: Interleaved1F1B runs them in rounds"),
    ((2, 1, "1F1B", 4, 4, 6), "strategy.microbatches=4: data.batch_size=6 (per data-parallel rank) does not divide"),
    ((0, 1, "1F1B", 4, 4, 8), "strategy.pipeline_parallel_size=0: must be an integer >= 1"),
])
def test_pipeline_settings_are_checked_in_one_line_naming_the_key(arguments, message):
    if message is None:
        check_pipeline(*arguments)
        return
    with pytest.raises(ValueError) as error:
        check_pipeline(*arguments)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


GPIPE_2_STAGES = "0F0,0F1,0B0,0B1\n1F0,1F1,1B1,1B0\n"


@pytest.mark.parametrize(("written", "message"), [
    (GPIPE_2_STAGES, None),
    ("0F0,0F1,0B0,0B1\n", "holds 1 row(s) of actions, one per pipeline rank is needed: strategy.pipeline_parallel_size=2"),
    ("0F0,0F1,0B0,0B1\n1F0,1X1,1B1,1B0\n", "row 2 holds '1X1', not an action (stage, F, B, I or W, microbatch:"),
    ("0F0,0F1,0B0,0B1\n1F0,1F2,1B1,1B0\n", "row 2 holds 1F2, of stage 1 and microbatch 2; this layout has stages 0-1"),
    ("0F0,0F1,0B0,0B1\n1F0,1B0\n", "no row runs 1F1 (stage 1's forward of microbatch 1); 1 forward(s) are missing"),
    (None, "cannot be read (No such file or directory); pass a schedule's .csv file"),
], ids=["gpipe", "a row short", "not an action", "no such microbatch", "a forward missing", "no file"])
def test_a_schedule_file_is_checked_before_any_rank_starts(written, message, tmp_path):
    """torch reads the file only once every rank has built its stages: a mistake in it cost each rank's start."""
    schedule = tmp_path / "schedule.csv"
    if written is not None:
        schedule.write_text(written)
    if message is None:
        assert check_pipeline(2, 1, str(schedule), 2, 4, 8).stages == 2
        return
    with pytest.raises(ValueError) as error:
        check_pipeline(2, 1, str(schedule), 2, 4, 8)
    assert str(error.value).startswith(f"strategy.pipeline_schedule={schedule}: {message}"), str(error.value)
    assert "\n" not in str(error.value)


def test_a_model_that_does_not_say_how_to_enter_its_blocks_is_told_what_it_needs():
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(TransformerBlock(8, 2, 0.0) for _ in range(2))

    with pytest.raises(ValueError) as error:
        find_trunk(Stack(), (TransformerBlock,), KEY)
    assert str(error.value) == (
        f"{KEY}: Stack (the module holding layers) must define embed(*inputs) -> hidden and head(hidden) -> outputs,"
        " so that each stage can run its part (or be a transformers model with a pipeline plan); it lacks embed and"
        " head")
    with pytest.raises(ValueError, match=rf"^{KEY}: pipeline stages split one nn.ModuleList of the model's blocks"
                                         r" \(Linear\); found none$"):
        find_trunk(nn.Sequential(nn.Linear(2, 2)), (nn.Linear,), KEY)


def test_each_stage_keeps_its_part_under_the_whole_models_names():
    model = gpt()
    names = set(model.state_dict())
    layout = PipelineLayout(pp=2, stages_per_rank=1, blocks=4)
    trunk = find_trunk(model, (TransformerBlock,), KEY)
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    prune_to_stages(first, trunk, layout, [0])
    prune_to_stages(last, trunk, layout, [1])
    kept_first, kept_last = set(first.state_dict()), set(last.state_dict())
    assert kept_first | kept_last == names  # every name on some stage; the tied head's on the last
    assert {name.split(".")[1] for name in kept_first} == {"token_embedding", "position_embedding", "blocks"}
    assert {name.split(".")[2] for name in kept_first if ".blocks." in name} == {"0", "1"}
    assert {name.split(".")[1] for name in kept_last} == {"blocks", "ln_out", "lm_head"}
    assert {name.split(".")[2] for name in kept_last if ".blocks." in name} == {"2", "3"}
    assert [len(m.model.blocks) for m in (first, last)] == [2, 2]  # iterated in order, their indices kept


def test_the_stages_in_a_row_compute_the_models_forward():
    model = gpt().eval()
    tokens = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(1))
    layout = PipelineLayout(pp=2, stages_per_rank=2, blocks=4, schedule="Interleaved1F1B")
    trunk = find_trunk(model, (TransformerBlock,), KEY)
    views = [StageView(model, trunk, layout, stage) for stage in range(4)]
    hidden = tokens
    for view in views:
        hidden = view(hidden)
    with torch.no_grad():
        torch.testing.assert_close(hidden, model(tokens), rtol=0, atol=0)
    assert [sorted(view.ends) for view in views] == [["position_embedding", "token_embedding"], [], [],
                                                     ["lm_head", "ln_out"]]
    # Each stage owns its own parameters; unsplit (no rank has pruned its copy), the first and the last share the
    # tied weight, which a split gives each its copy of (TiedCopies).
    owned = [{id(p) for p in view.parameters()} for view in views]
    shared = {(i, j): owned[i] & owned[j] for i in range(4) for j in range(i + 1, 4) if owned[i] & owned[j]}
    assert shared == {(0, 3): {id(model.model.token_embedding.weight)}}
    split = PipelineSplit.of(model, trunk, layout, pp_rank=0)
    assert split.tied == (("model.token_embedding.weight", "model.lm_head.weight"),)
    assert split.holders == ((0, 1),) and split.embeddings == (True,)  # stage 3 is rank 1's under interleaving


def llama():
    """A config-built transformers Llama (grouped-query attention, rotary positions), as the recipe builds it."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])  # the causal mask made by each stage, or SDPA's own
def test_a_transformers_llamas_stages_in_a_row_compute_its_logits_and_loss(attention):
    holder = nn.Module()
    holder.model = llama().eval()  # as a LightningModule holds it
    holder.model.config._attn_implementation = attention
    blocks = (type(holder.model.model.layers[0]),)
    tokens = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    layout = PipelineLayout(pp=2, stages_per_rank=2, blocks=4, schedule="Interleaved1F1B")
    trunk = find_trunk(holder, blocks, KEY)
    assert (trunk.name, trunk.stack, trunk.kind) == ("model", "model.layers", "transformers")
    views = [StageView(holder, trunk, layout, stage) for stage in range(4)]
    assert [sorted(view.ends) for view in views] == [["model_embed_tokens"], [], [], ["lm_head", "model_norm"]]
    hidden = views[0](input_ids=tokens)
    for view in views[1:]:
        hidden = view(hidden)
    with torch.no_grad():
        whole = holder.model(input_ids=tokens, labels=tokens)
    torch.testing.assert_close(hidden, whole.logits, rtol=1e-6, atol=1e-6)
    answered = views[-1].answer(hidden, (), {"input_ids": tokens, "labels": tokens})
    torch.testing.assert_close(answered.loss, whole.loss, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"^pipeline parallelism: LlamaForCausalLM is called with attention_mask,"):
        views[0](input_ids=tokens, attention_mask=torch.ones_like(tokens))


def test_a_transformers_llama_pruned_to_its_last_stage_keeps_the_norm_and_head_by_their_names():
    holder = nn.Module()
    holder.model = llama()
    blocks = (type(holder.model.model.layers[0]),)
    layout = PipelineLayout(pp=2, stages_per_rank=1, blocks=4)
    trunk = find_trunk(holder, blocks, KEY)
    first, last = copy.deepcopy(holder), copy.deepcopy(holder)
    prune_to_stages(first, trunk, layout, [0])
    prune_to_stages(last, trunk, layout, [1])
    assert sorted({name.rsplit(".", 1)[0] for name in first.state_dict() if "layers" not in name}) == [
        "model.model.embed_tokens"]
    assert sorted({name.rsplit(".", 1)[0] for name in last.state_dict() if "layers" not in name}) == [
        "model.lm_head", "model.model.norm"]
    assert {name.split(".")[3] for name in last.state_dict() if ".layers." in name} == {"2", "3"}
    split = PipelineSplit.of(holder, trunk, layout, pp_rank=1)
    names = ("model.model.embed_tokens.weight", "model.model.norm.weight", "model.lm_head.weight",
             "model.model.layers.2.mlp.up_proj.weight", "model.model.layers.1.mlp.up_proj.weight")
    assert [split.stage_of(holder, name) for name in names] == [0, 1, 1, 1, 0]


def test_held_stages_are_known_by_their_modules_and_leave_the_parameters_swappable():
    """`module.to()` swaps FSDP2's DTensor parameters on torch 2.11, which a weak reference to a parameter refuses:
    the pipeline's groups are kept by module ("Cannot swap t1 because it has weakref associated with it" there)."""
    import weakref

    from lightning_dist.parallel.pipeline_split import hold_stages, stage_group

    model, group = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2))), object()
    assert stage_group(model) is None
    hold_stages(model, group)
    assert stage_group(model) is group and stage_group(model[1]) is group  # a submodule: a PEFT model's, say
    assert all(weakref.getweakrefs(param) == [] for param in model.parameters())
    torch.utils.swap_tensors(model[0].weight, nn.Parameter(torch.zeros(2, 2)))
