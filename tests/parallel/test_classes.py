import pytest
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn

from lightning_dist.models.gpt import GPT, TransformerBlock
from lightning_dist.parallel import (
    infer_block_classes,
    require_classes_in_model,
    resolve_block_classes,
    resolve_module_class,
)


def test_resolves_dotted_path_and_class():
    assert resolve_module_class("lightning_dist.models.gpt.TransformerBlock", "k") is TransformerBlock
    assert resolve_module_class(TransformerBlock, "k") is TransformerBlock


def test_unknown_class_names_key_and_the_classes_that_exist():
    with pytest.raises(ValueError) as error:
        resolve_module_class("lightning_dist.models.gpt.TransformerBlok", "model.block_class")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("model.block_class: 'lightning_dist.models.gpt.TransformerBlok'")
    assert "CausalSelfAttention, GPT, GPTLanguageModel, TransformerBlock" in message


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [("Block", "not a dotted class path"), ("no_such_pkg.Block", "cannot import module 'no_such_pkg'")],
)
def test_malformed_paths(spec, fragment):
    with pytest.raises(ValueError, match=fragment):
        resolve_module_class(spec, "strategy.block_class")


def test_not_a_module_class():
    with pytest.raises(TypeError, match="not a torch.nn.Module subclass"):
        resolve_module_class(int, "strategy.block_class")


def test_block_classes_one_or_several():
    assert resolve_block_classes("lightning_dist.models.gpt.TransformerBlock", "k") == (TransformerBlock,)
    both = ["torch.nn.TransformerEncoderLayer", nn.TransformerDecoderLayer, nn.TransformerDecoderLayer]
    assert resolve_block_classes(both, "k") == (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
    with pytest.raises(ValueError, match=r"^strategy.block_class: an empty list names no block class"):
        resolve_block_classes([], "strategy.block_class")


def test_block_must_be_in_the_model():
    gpt = GPT(32, 8, 2, 2, 16, 0.0)
    assert require_classes_in_model(gpt, (TransformerBlock,), "k") == 2
    with pytest.raises(ValueError, match=r"strategy.block_class: the model has no Conv2d module; classes in the model: .*GPT"):
        require_classes_in_model(gpt, (TransformerBlock, nn.Conv2d), "strategy.block_class")


def test_infers_block_class_from_module_lists():
    assert infer_block_classes(GPT(32, 8, 2, 2, 16, 0.0)) == (TransformerBlock,)
    assert infer_block_classes(BoringModel()) == ()


def test_infers_the_block_class_of_a_pipeline_stage_s_stack():
    """A stage keeps its blocks under their model-wide names (pipeline_split.py): the second of two holds only "1".
    `trainer.test()` after `fit()` looks for the blocks in it again: `python train.py model=hf_llama
    strategy=fsdp_pp` stopped there with `KeyError: '0'`."""
    from lightning_dist.parallel.pipeline_layout import PipelineLayout
    from lightning_dist.parallel.pipeline_split import find_trunk, prune_to_stages

    model = GPT(32, 8, 2, 2, 16, 0.0)
    prune_to_stages(model, find_trunk(model, (TransformerBlock,), "k"), PipelineLayout(2, 1, 2), [1])
    assert [name for name, _ in model.blocks.named_children()] == ["1"]
    assert infer_block_classes(model) == (TransformerBlock,)


def test_infers_both_stacks_of_an_encoder_decoder():
    model = nn.Transformer(8, 2, num_encoder_layers=2, num_decoder_layers=3, dim_feedforward=16, batch_first=True)
    assert infer_block_classes(model) == (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


class SubLayers(nn.Module):
    """A T5-style block: its own sub-layers of different classes in an nn.ModuleList."""

    def __init__(self):
        super().__init__()
        self.layer = nn.ModuleList([nn.Linear(4, 4), nn.LayerNorm(4)])
        self.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])


def test_lists_inside_a_block_and_lists_of_lists_are_no_stacks():
    model = nn.Module()
    model.stages = nn.ModuleList([nn.ModuleList([SubLayers(), SubLayers()]), nn.ModuleList([SubLayers()])])
    assert infer_block_classes(model) == (SubLayers,)


def test_a_list_mixing_classes_is_refused_naming_them():
    model = nn.Module()
    model.blocks = nn.ModuleList([TransformerBlock(8, 2, 0.0) for _ in range(2)])
    model.head = nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])
    with pytest.raises(ValueError) as error:
        infer_block_classes(model, "strategy.block_class")
    assert str(error.value) == (
        "strategy.block_class: cannot infer the model's block class: an nn.ModuleList mixes Linear, ReLU"
        " (single-class stacks: TransformerBlock); set it to the layer class, or a list of them"
    )


def test_one_definition_of_a_block_for_fsdp_zero3_and_the_planner():
    from lightning_dist.memory.model_facts import ModelFacts
    from lightning_dist.models.gpt import GPTLanguageModel
    from lightning_dist.parallel.classes import block_modules
    from lightning_dist.strategies.deepspeed.config.gathering import largest_block

    model = GPTLanguageModel()
    blocks = list(model.model.blocks)
    assert block_modules(model) == blocks == block_modules(model, (TransformerBlock,))  # inferred, or as configured
    size = sum(p.numel() for p in blocks[0].parameters())
    # ZeRO-3's live-parameter sizing and the planner read the same blocks, configured or not.
    assert largest_block(model) == ModelFacts.of(GPTLanguageModel).largest_block == size
    assert ModelFacts.of(GPTLanguageModel, block_classes=(TransformerBlock,)).largest_block == size
    # A list whose classes cannot be read as a stack: no blocks (the strategies refuse it by name).
    mixed = nn.Sequential(nn.ModuleList([nn.Linear(2, 2), nn.ReLU()]))
    assert block_modules(mixed) == [] and largest_block(mixed) == 0
