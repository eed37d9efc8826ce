import pytest

from lightning_dist.models.gpt import TransformerBlock


@pytest.fixture
def block_forwards(monkeypatch) -> list[int]:
    """Counts TransformerBlock.forward calls. (Forward hooks would not see them: recomputation bypasses hooks.)"""
    calls = [0]
    forward = TransformerBlock.forward

    def counting_forward(self, x):
        calls[0] += 1
        return forward(self, x)

    monkeypatch.setattr(TransformerBlock, "forward", counting_forward)
    return calls
