import pytest
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn

from lightning_dist.models.gpt import GPT, TransformerBlock
from lightning_dist.parallel import infer_block_class, require_class_in_model, resolve_module_class


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


def test_block_must_be_in_the_model():
    gpt = GPT(32, 8, 2, 2, 16, 0.0)
    assert require_class_in_model(gpt, TransformerBlock, "k") == 2
    with pytest.raises(ValueError, match=r"strategy.block_class: the model has no Conv2d module; classes in the model: .*GPT"):
        require_class_in_model(gpt, nn.Conv2d, "strategy.block_class")


def test_infers_block_class_from_module_lists():
    assert infer_block_class(GPT(32, 8, 2, 2, 16, 0.0)) is TransformerBlock
    assert infer_block_class(BoringModel()) is None
    mixed = nn.Module()
    mixed.layers = nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])
    assert infer_block_class(mixed) is None
