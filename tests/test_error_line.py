"""A run's `error: ...` line leaves in one write: ranks sharing torchrun's stderr said the same refusal at once, and
print's two writes (text, newline) joined two ranks' lines into one (CI: `error: ...1error: ...1`)."""

from __future__ import annotations

import io
import sys

import pytest

from lightning_dist.lifecycle.error_line import say_error
from lightning_dist.lifecycle.exits import exit_with


class Writes(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return super().write(text)


def test_the_line_and_its_newline_are_one_write(monkeypatch):
    stderr = Writes()
    monkeypatch.setattr(sys, "stderr", stderr)
    say_error("trainer.devices=1: torchrun started 2 ranks on this node")
    assert stderr.calls == ["error: trainer.devices=1: torchrun started 2 ranks on this node\n"]


def test_a_refusal_is_said_in_one_write(monkeypatch):
    stderr = Writes()
    monkeypatch.setattr(sys, "stderr", stderr)
    with pytest.raises(SystemExit) as leaving:
        exit_with(ValueError("model.top_k=9: choose from 1 to model.n_experts=8"), code=1)
    assert leaving.value.code == 1
    assert stderr.calls == ["error: model.top_k=9: choose from 1 to model.n_experts=8\n"]
