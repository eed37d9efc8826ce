"""AutoEP's layers back in the model's names (checkpoints/autoep_names.py): w1 and w3 into transformers' fused
gate_up_proj in either of its layouts, w2 into down_proj, the router and shared experts renamed, and one line for
anything that does not come back whole. The whole path (a DeepSpeed AutoEP run, consolidated, resumed under ddp and
fsdp): tests/strategies/test_deepspeed_expert_parallel.py."""

from __future__ import annotations

import pytest
import torch

from lightning_dist.checkpoints.autoep_names import in_autoep_names, in_model_names
from lightning_dist.checkpoints.formats import CheckpointError

BLOCK = "model.model.layers.0.mlp"
EXPERTS, FFN, HIDDEN = 4, 3, 5


def layout(parameters: dict[str, list[int]], w3: str | None = None, shared: str | None = None) -> dict:
    return {BLOCK: {"router": "gate", "shared_experts": shared, "shared_experts_gate": None, "experts": "experts",
                    "w1": "gate_up_proj" if w3 is None else "gate_proj", "w2": "down_proj", "w3": w3,
                    "parameters": parameters}}


def autoep_tensors(**extra: torch.Tensor) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {f"{BLOCK}.router.gate.weight": torch.randn(EXPERTS, HIDDEN),
            f"{BLOCK}.experts.w1": torch.randn(EXPERTS, FFN, HIDDEN), f"{BLOCK}.experts.w3": torch.randn(EXPERTS, FFN, HIDDEN),
            f"{BLOCK}.experts.w2": torch.randn(EXPERTS, HIDDEN, FFN), "model.lm_head.weight": torch.randn(7, HIDDEN),
            **{f"{BLOCK}.{name}": tensor for name, tensor in extra.items()}}


def test_fused_gate_up_is_gate_then_up_on_the_ffn_dimension_as_transformers_computes_it():
    saved = autoep_tensors()
    named = in_model_names(saved, layout({"gate.weight": [EXPERTS, HIDDEN],
                                          "experts.gate_up_proj": [EXPERTS, 2 * FFN, HIDDEN],
                                          "experts.down_proj": [EXPERTS, HIDDEN, FFN]}))
    assert sorted(named) == sorted(["model.lm_head.weight", f"{BLOCK}.gate.weight", f"{BLOCK}.experts.gate_up_proj",
                                    f"{BLOCK}.experts.down_proj"])
    fused = named[f"{BLOCK}.experts.gate_up_proj"]
    assert torch.equal(fused[:, :FFN], saved[f"{BLOCK}.experts.w1"])
    assert torch.equal(fused[:, FFN:], saved[f"{BLOCK}.experts.w3"])
    tokens = torch.randn(2, HIDDEN)
    gate, up = (tokens @ fused[1].T).chunk(2, dim=-1)  # as transformers' Mixtral experts compute, expert 1
    torch.testing.assert_close(gate, tokens @ saved[f"{BLOCK}.experts.w1"][1].T)
    torch.testing.assert_close(up, tokens @ saved[f"{BLOCK}.experts.w3"][1].T)
    assert torch.equal(named[f"{BLOCK}.experts.down_proj"], saved[f"{BLOCK}.experts.w2"])
    assert torch.equal(named[f"{BLOCK}.gate.weight"], saved[f"{BLOCK}.router.gate.weight"])


def test_the_hidden_first_layout_is_the_same_experts_transposed():
    saved = autoep_tensors()
    named = in_model_names(saved, layout({"gate.weight": [EXPERTS, HIDDEN],
                                          "experts.gate_up_proj": [EXPERTS, HIDDEN, 2 * FFN],
                                          "experts.down_proj": [EXPERTS, FFN, HIDDEN]}))
    assert torch.equal(named[f"{BLOCK}.experts.gate_up_proj"][:, :, :FFN], saved[f"{BLOCK}.experts.w1"].mT)
    assert torch.equal(named[f"{BLOCK}.experts.gate_up_proj"][:, :, FFN:], saved[f"{BLOCK}.experts.w3"].mT)
    assert torch.equal(named[f"{BLOCK}.experts.down_proj"], saved[f"{BLOCK}.experts.w2"].mT)


def test_separate_gate_and_up_and_shared_experts_keep_their_own_names():
    shared = torch.randn(FFN, HIDDEN)
    saved = autoep_tensors(**{"shared_experts.up.weight": shared})
    named = in_model_names(saved, layout({"gate.weight": [EXPERTS, HIDDEN], "experts.gate_proj": [EXPERTS, FFN, HIDDEN],
                                          "experts.up_proj": [EXPERTS, FFN, HIDDEN],
                                          "experts.down_proj": [EXPERTS, HIDDEN, FFN],
                                          "shared_expert.up.weight": [FFN, HIDDEN]}, w3="up_proj", shared="shared_expert"))
    assert torch.equal(named[f"{BLOCK}.experts.up_proj"], saved[f"{BLOCK}.experts.w3"])
    assert torch.equal(named[f"{BLOCK}.shared_expert.up.weight"], shared)


@pytest.mark.parametrize("fused, down", [([EXPERTS, 2 * FFN, HIDDEN], [EXPERTS, HIDDEN, FFN]),
                                         ([EXPERTS, HIDDEN, 2 * FFN], [EXPERTS, FFN, HIDDEN])],
                         ids=["ffn_first", "hidden_first"])
def test_the_model_s_names_go_back_into_autoep_s_exactly(fused, down):
    """A checkpoint of another strategy resumed under AutoEP: the inverse, in both fused layouts."""
    blocks = layout({"gate.weight": [EXPERTS, HIDDEN], "experts.gate_up_proj": fused, "experts.down_proj": down})
    saved = autoep_tensors()
    back = in_autoep_names(in_model_names(saved, blocks), blocks)
    assert back.keys() == saved.keys() and all(torch.equal(back[name], saved[name]) for name in saved)


def test_what_does_not_come_back_whole_is_one_line():
    parameters = {"gate.weight": [EXPERTS, HIDDEN], "experts.gate_up_proj": [EXPERTS, 2 * FFN, HIDDEN],
                  "experts.down_proj": [EXPERTS, HIDDEN, FFN]}
    with pytest.raises(CheckpointError) as unplaced:
        in_model_names(autoep_tensors(**{"router.e_score_correction_bias": torch.zeros(EXPERTS)}), layout(parameters))
    assert str(unplaced.value) == (
        f"checkpoint: AutoEP's {BLOCK}.router.e_score_correction_bias has no place in the model's {BLOCK} (it held"
        " experts.down_proj, experts.gate_up_proj, gate.weight); report this with your DeepSpeed version")
    with pytest.raises(CheckpointError) as missing:
        in_model_names(autoep_tensors(), layout({**parameters, "gate.bias": [EXPERTS]}))
    assert str(missing.value) == (f"checkpoint: the model's {BLOCK}.gate.bias [{EXPERTS}] came back from AutoEP's"
                                  " layer as nothing; report this with your DeepSpeed version")
    with pytest.raises(CheckpointError, match="fit neither fused layout"):
        in_model_names(autoep_tensors(), layout({**parameters, "experts.down_proj": [EXPERTS, FFN, FFN]}))
