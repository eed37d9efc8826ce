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
