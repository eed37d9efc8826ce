"""`lightning-dist generate`: text from the bundled GPT of a checkpoint. A GPT trained on a repeating text continues
it; a checkpoint of another model is refused in one line (by `export` too); `lightning-dist` names its commands.
A Hugging Face model's text: tests/recipes/test_hf_causal_lm.py and test_finetune.py."""

from __future__ import annotations

import subprocess
import sys

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist.models.generate import generate, load_gpt
from lightning_dist.models.gpt import GPTLanguageModel
from tests.conftest import REPO

TEXT = b"abcd" * 64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny GPT trained on "abcdabcd..." until it predicts every next byte, saved as train.py's runs save."""
    torch.manual_seed(0)
    data = torch.tensor(list(TEXT))
    windows = data.unfold(0, 9, 1)  # 8 inputs and the 8 bytes after them
    loader = DataLoader(TensorDataset(windows[:, :-1], windows[:, 1:]), batch_size=32, shuffle=True)
    model = GPTLanguageModel(block_size=8, n_layer=1, n_head=2, d_model=32,
                             optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=60, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, train_dataloaders=loader)
    path = tmp_path_factory.mktemp("gpt") / "last.ckpt"
    trainer.save_checkpoint(path)
    return path


def test_the_trained_gpt_continues_its_text_and_the_command_prints_it(checkpoint):
    assert generate(load_gpt(checkpoint), "ab", new_tokens=10) == "abcdabcdabcd"
    # Drawn at a temperature: the same draws for the same seed.
    drawn = [generate(load_gpt(checkpoint), "ab", new_tokens=10, temperature=1.0, seed=3) for _ in range(2)]
    assert drawn[0] == drawn[1] and drawn[0].startswith("ab")
    command = [sys.executable, "-m", "lightning_dist.commands", "generate", str(checkpoint), "--prompt", "cd",
               "--bytes", "6"]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert (run.returncode, run.stdout) == (0, "cdabcdab\n"), run.stderr[-2000:]


def test_another_models_checkpoint_is_refused_in_one_line(tmp_path, capsys):
    class Regressor(L.LightningModule):
        def __init__(self, width: int = 4):
            super().__init__()
            self.save_hyperparameters()
            self.layer = torch.nn.Linear(width, 1)

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.strategy.connect(Regressor())
    path = tmp_path / "regressor.ckpt"
    trainer.save_checkpoint(path)
    run = subprocess.run([sys.executable, "-m", "lightning_dist.commands", "generate", str(path)], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip().splitlines()[-1] == (
        f"error: checkpoint: {path} holds neither the bundled GPT nor a Hugging Face model (its hyper-parameters name"
        " no model_type, and lack vocab_size, block_size, n_layer, n_head, d_model)")
    from lightning_dist.models.export import main as export

    assert export([str(path), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == ((
        f"error: checkpoint: {path} holds another model, not a Hugging Face model (model=hf_*); `lightning-dist"
        " consolidate` writes any checkpoint as one file\n"))
    assert not (tmp_path / "out").exists()


def test_lightning_dist_names_its_commands_and_refuses_others():
    from lightning_dist.commands import main, usage

    assert main([]) == 2 and main(["--help"]) == 0
    assert [line.split()[0] for line in usage().splitlines()[2:7]] == ["consolidate", "export", "generate", "prepare",
                                                                      "sweep-report"]
    run = subprocess.run([sys.executable, "-m", "lightning_dist.commands", "fit"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert (run.returncode, run.stderr.strip()) == (2, "error: lightning-dist fit: no such command; choose one of"
                                                       " consolidate, export, generate, prepare, sweep-report")


def test_a_folder_with_a_tokenizer_reads_and_writes_text_through_it(tmp_path, capsys):
    """A save_pretrained folder with its tokenizer (as the Hub's are): the prompt is encoded by it, the new tokens
    decoded by it; without one, a model whose vocabulary is not bytes is refused in one line."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from lightning_dist.models.generate import main

    words = ["<unk>", "the", "cat", "sat", "on", "mat", "a", "dog"]
    backend = Tokenizer(models.WordLevel({word: index for index, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(words), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         bos_token_id=None, eos_token_id=None, pad_token_id=None))
    model.save_pretrained(tmp_path / "bare")
    capsys.readouterr()  # transformers' progress bar of the save
    assert main([str(tmp_path / "bare"), "--prompt", "the cat", "--tokens", "4"]) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path / 'bare'}: its model reads 8 tokens and no tokenizer is saved beside it (no tokenizer.json"
        f" in {tmp_path / 'bare'}); save its tokenizer there (`tokenizer.save_pretrained(folder)`)\n")
    model.save_pretrained(tmp_path / "with_tokenizer")
    tokenizer.save_pretrained(tmp_path / "with_tokenizer")
    capsys.readouterr()
    assert main([str(tmp_path / "with_tokenizer"), "--prompt", "the cat", "--tokens", "4"]) == 0
    # What transformers writes greedily after the prompt's two words, decoded by the same tokenizer.
    with torch.no_grad():
        written = model.eval().generate(input_ids=torch.tensor([[1, 2]]), max_new_tokens=4, do_sample=False,
                                        pad_token_id=0)[0, 2:].tolist()
    assert capsys.readouterr().out == tokenizer.decode([1, 2, *written]) + "\n"  # "the cat sat ...", spaced
    assert len(written) == 4 and all(0 <= token < len(words) for token in written)
    assert tokenizer.decode([1, 2, *written]).startswith("the cat ")
