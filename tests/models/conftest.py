import pytest

from recipes.finetune.make_pretrained import make_pretrained


@pytest.fixture(scope="session")
def pretrained_folders(tmp_path_factory) -> dict:
    """"Pretrained" transformers models on disk, as `save_pretrained` writes them (bf16, several shards and an
    index): Llama with its own head, Qwen2 with the head tied to the embedding, Mixtral (a mixture of experts)."""
    root = tmp_path_factory.mktemp("pretrained")
    folders = {}
    for model in ("llama", "qwen2", "mixtral"):
        make_pretrained(root / model, model)
        folders[model] = root / model
    return folders
