"""Checkpoints saved with `ModelCheckpoint(save_weights_only=True)` (lightning-hydra-template's key): a test reads
their weights under any engine, and a run never trains on from one. Lightning stopped at its optimizer's restore
after every rank had started (`KeyError: 'Trying to restore optimizer state but checkpoint contains only the
model...'`), FSDP's reader before it with `RuntimeError: Missing key in checkpoint state_dict: optimizer_0.state...`,
and `resume=true` picked them as the newest save to continue from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_dist.checkpoints.contents import saved_weights_only
from tests.conftest import REPO, TRAIN_ENV

pytestmark = pytest.mark.slow

SAVES_WEIGHTS_ONLY = ("trainer.max_steps=3", "callbacks.model_checkpoint.save_weights_only=true",
                      "callbacks.model_checkpoint.every_n_train_steps=3", "callbacks.model_checkpoint.monitor=null",
                      "callbacks.model_checkpoint.save_top_k=-1")


def train(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`python train.py ...` as a user types it, from `cwd`."""
    return subprocess.run([sys.executable, str(REPO / "train.py"), *overrides], cwd=cwd, env=TRAIN_ENV,
                          capture_output=True, text=True, timeout=600)


def test_a_weights_only_checkpoint_is_tested_under_another_engine_and_never_trained_on_from(tmp_path):
    saved = train(tmp_path, "strategy=fsdp", *SAVES_WEIGHTS_ONLY)
    assert saved.returncode == 0, saved.stderr[-3000:]
    (run,) = (tmp_path / "logs" / "train" / "runs").iterdir()
    checkpoint = run / "checkpoints" / "step000003.ckpt"
    assert saved_weights_only(checkpoint)
    tested_after_fit = json.loads((run / "metrics.json").read_text())["metrics"]["test_loss"]

    # Resumed to train: one line, before any rank starts, whichever engine.
    refused = train(tmp_path, "strategy=deepspeed_stage_2", f"ckpt_path={checkpoint}", "trainer.max_steps=6")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert refused.stderr.splitlines()[0] == (
        f"error: ckpt_path: {checkpoint} holds the model's weights only (saved with save_weights_only=True): no"
        f" optimizer state to train on from; test it with train=false ckpt_path={checkpoint}, or save whole"
        " checkpoints to resume")

    # Tested as the refusal says, under ddp: the weights the run tested after fit.
    tested = train(tmp_path, "strategy=ddp", "train=false", f"ckpt_path={checkpoint}")
    assert tested.returncode == 0, tested.stderr[-3000:]
    assert f"test_loss={tested_after_fit:.4f}" in tested.stdout + tested.stderr

    # The same command again with resume=true passes over its saves, each named with why, and starts afresh.
    again = train(tmp_path, "strategy=fsdp", *SAVES_WEIGHTS_ONLY, "resume=true")
    assert again.returncode == 0, again.stderr[-3000:]
    said = again.stdout + again.stderr
    assert (f"resume=true: passed over {checkpoint}: it holds the model's weights only (saved with"
            " save_weights_only=True), nothing to train on from") in said
    assert "resume=true: no earlier complete checkpoint of this command (passed over 2, named above); starting" in said


USERS_SCRIPT = """
import sys

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_dist  # noqa: F401  (registers ld_fsdp)

step, ckpt_path = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ld_fsdp", max_steps=4, logger=False,
                    enable_progress_bar=False, callbacks=[ModelCheckpoint(dirpath="checkpoints", save_weights_only=True,
                                                                          every_n_train_steps=2)])
if step == "test":
    trainer.test(BoringModel(), ckpt_path=ckpt_path)
else:
    trainer.fit(BoringModel(), ckpt_path=ckpt_path)
"""


def test_a_users_trainer_is_refused_in_one_line_and_tests_it(tmp_path):
    (tmp_path / "train_boring.py").write_text(USERS_SCRIPT)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "train_boring.py", *args], cwd=tmp_path, capture_output=True, text=True,
                              env={**TRAIN_ENV, "PYTHONPATH": str(REPO)}, timeout=600)

    saved = run("fit")
    assert saved.returncode == 0, saved.stderr[-3000:]
    checkpoint = tmp_path / "checkpoints" / "epoch=0-step=4.ckpt"
    assert saved_weights_only(checkpoint)
    resumed = run("fit", str(checkpoint))
    assert resumed.returncode != 0
    assert (f"CheckpointError: ckpt_path: {checkpoint} holds the model's weights only (saved with"
            " save_weights_only=True): no optimizer state to train on from; test it with trainer.test(model,"
            " ckpt_path=...), or save whole checkpoints to resume") in resumed.stderr
    assert "Missing key in checkpoint state_dict" not in resumed.stderr  # FSDP's reader, before
    tested = run("test", str(checkpoint))
    assert tested.returncode == 0, tested.stderr[-3000:]


def test_what_lightning_leaves_out_of_a_weights_only_save_tells_it_apart(tmp_path):
    lightning = {"pytorch-lightning_version": "2.6.6", "epoch": 0, "global_step": 3, "state_dict": {}, "loops": {}}
    for name, checkpoint, weights_only in [
        ("weights_only.ckpt", lightning, True),
        ("whole.ckpt", {**lightning, "callbacks": {}, "optimizer_states": [], "lr_schedulers": []}, False),
        ("another_library.ckpt", {"state_dict": {}}, False),  # not Lightning's: nothing to tell
    ]:
        torch.save(checkpoint, tmp_path / name)
        assert saved_weights_only(tmp_path / name) is weights_only, name
