"""`lightning-dist generate`: text from the bundled GPT of a checkpoint. A GPT trained on a repeating text continues
it; a checkpoint of another model is refused in one line; `lightning-dist` names its commands."""

from __future__ import annotations

import subprocess
import sys

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist.generate import generate, load_gpt
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
    assert generate(load_gpt(checkpoint), "ab", new_bytes=10) == "abcdabcdabcd"
    # Drawn at a temperature: the same draws for the same seed.
    drawn = [generate(load_gpt(checkpoint), "ab", new_bytes=10, temperature=1.0, seed=3) for _ in range(2)]
    assert drawn[0] == drawn[1] and drawn[0].startswith("ab")
    command = [sys.executable, "-m", "lightning_dist.commands", "generate", str(checkpoint), "--prompt", "cd",
               "--bytes", "6"]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert (run.returncode, run.stdout) == (0, "cdabcdab\n"), run.stderr[-2000:]


def test_another_models_checkpoint_is_refused_in_one_line(tmp_path):
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
        f"error: checkpoint: {path} is not of the bundled byte-level GPT (its hyper-parameters lack vocab_size,"
        " block_size, n_layer, n_head, d_model); a Hugging Face model's: export it (python -m"
        " recipes.hf_causal_lm.export) and call its generate")


def test_lightning_dist_names_its_commands_and_refuses_others():
    from lightning_dist.commands import main, usage

    assert main([]) == 2 and main(["--help"]) == 0
    assert [line.split()[0] for line in usage().splitlines()[2:6]] == ["consolidate", "generate", "prepare",
                                                                      "sweep-report"]
    run = subprocess.run([sys.executable, "-m", "lightning_dist.commands", "export"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert (run.returncode, run.stderr.strip()) == (
        2, "error: lightning-dist export: no such command; choose one of consolidate, generate, prepare, sweep-report")
