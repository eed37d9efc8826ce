"""A LoRA fine-tune's checkpoints without its frozen base (`DeepSpeedStrategy(exclude_frozen_parameters=True)`, as
Lightning users write it, and ours under fsdp and ddp; tests/lora_checkpoint_script.py: a Qwen2 from a pretrained
folder, its head tied to its embedding as Qwen2.5's and Llama 3.2's small models have it, AdamW over
`self.parameters()`, a checkpoint every 2 steps) hold the adapters and their optimizer state only, and resume:

- under ZeRO-3 and fsdp from step 4, steps 5-6 train the uninterrupted run's losses exactly (Lightning wrote such
  checkpoints under DeepSpeed and could not load them: `Missing key(s) in state_dict`); ddp's under ZeRO-3;
- under ddp and fsdp (other engines), the frozen base kept as the model was built; before, any DeepSpeed checkpoint of
  such a module stopped a ddp or fsdp resume: "no optimizer state for" the frozen weights `AdamW(self.parameters())`
  holds;
- the tied head is left out under both its names: ddp, fsdp and ZeRO-1/2 saved the embedding whole under
  `lm_head.weight`, and ZeRO-3 an empty placeholder there, which a ddp or fsdp resume found lacking;
- a model built on other weights than the run saved with is refused in one line, not resumed on;
- `lightning_dist.load_from_checkpoint` builds the module and checks its frozen weights alike.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from lightning_dist.checkpoints.formats import CheckpointError
from lightning_dist.checkpoints.frozen_weights import (
    LEFT_OUT,
    check_left_out,
    fingerprint,
    frozen_fingerprints,
    load_around_left_out,
)
from tests.conftest import REPO, TRAIN_ENV

pytestmark = pytest.mark.slow

STEP_4 = "checkpoints/epoch=0-step=4.ckpt"


def run(out, folder, strategy: str, ckpt_path=None, expect_failure: bool = False) -> dict:
    """Rank 0's {global step: loss} of a 2-rank run of the script (about 35 s), or its stderr where it fails."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(REPO / "tests" / "lora_checkpoint_script.py"), str(out), str(folder), strategy, "2",
               "6", "true", *([str(ckpt_path)] if ckpt_path else [])]
    process = subprocess.run(command, cwd=out, env={**TRAIN_ENV, "PYTHONPATH": str(REPO)}, capture_output=True,
                             text=True, timeout=600)
    if expect_failure:
        assert process.returncode != 0, process.stdout[-2000:]
        return {"stderr": process.stderr}
    assert process.returncode == 0, process.stderr[-4000:]
    return {int(step): loss for step, loss in json.loads((out / "losses-0.json").read_text()).items()}


@pytest.fixture(scope="module")
def runs(pretrained_folders, tmp_path_factory, deepspeed_ops):
    folder = pretrained_folders["qwen2"]
    root = tmp_path_factory.mktemp("lora_checkpoints")
    whole = run(root / "zero3", folder, "3")
    checkpoint = root / "zero3" / STEP_4
    return {
        "checkpoint": checkpoint,
        "zero3": whole,
        "zero3_resumed": run(root / "zero3_resumed", folder, "3", checkpoint),
        "ddp_resumed": run(root / "ddp_resumed", folder, "ld_ddp", checkpoint),
        "fsdp_resumed": run(root / "fsdp_resumed", folder, "ld_fsdp", checkpoint),
        "fsdp": run(root / "fsdp", folder, "fsdp"),
        "fsdp_resumed_own": run(root / "fsdp_resumed_own", folder, "fsdp", root / "fsdp" / STEP_4),
        "ddp": run(root / "ddp", folder, "ddp"),
        "zero3_resumed_ddp_s": run(root / "zero3_resumed_ddp_s", folder, "3", root / "ddp" / STEP_4),
        # Another "pretrained" model of the same shape: its frozen weights are not the ones the run trained on.
        "other_base": run(root / "other_base", make_other_base(root), "2", checkpoint, expect_failure=True),
    }


def make_other_base(root):
    from recipes.finetune.make_pretrained import make_pretrained

    make_pretrained(root / "other_qwen2", "qwen2", seed=1)
    return root / "other_qwen2"


def test_the_checkpoint_holds_the_adapters_and_the_frozen_weights_fingerprints(runs):
    saved = [torch.load(path, weights_only=False, map_location="cpu")
             for path in sorted((runs["checkpoint"] / "checkpoint").glob("*model_states.pt"))]
    assert len(saved) == 2  # ZeRO-3: a model-states file per rank
    for states in saved:
        assert states["module"] and all("lora_" in name for name in states["module"])
        assert not states.get("frozen_param_fragments")
    left_out = saved[0][LEFT_OUT]
    assert len(left_out) == 51  # Qwen2's 4 layers of 12 weights (q, k and v have biases), its final norm, embedding
    assert "model.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight" in left_out
    head, embedding = "model.base_model.model.lm_head.weight", "model.base_model.model.model.embed_tokens.weight"
    assert left_out[head] == left_out[embedding]  # and the embedding again as the head it is tied to
    assert not any("lora_" in name for name in left_out)


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_a_resume_trains_the_uninterrupted_run_s_losses(runs, strategy):
    resumed = runs["zero3_resumed" if strategy == "zero3" else "fsdp_resumed_own"]
    assert resumed == {step: runs[strategy][step] for step in (5, 6)}


def test_fsdp_and_ddp_saves_hold_the_adapters_only(runs):
    from torch.distributed.checkpoint import FileSystemReader

    root = runs["checkpoint"].parents[2]
    ddp = torch.load(root / "ddp" / STEP_4, weights_only=False)
    assert ddp["state_dict"] and all("lora_" in name for name in ddp["state_dict"])
    zero3 = torch.load(runs["checkpoint"] / "checkpoint" / "zero_pp_rank_0_mp_rank_00_model_states.pt",
                       weights_only=False)
    assert sorted(ddp[LEFT_OUT]) == sorted(zero3[LEFT_OUT]) and len(ddp[LEFT_OUT]) == 51
    for name, entry in ddp[LEFT_OUT].items():  # the same bf16 base under both
        assert entry["shape"] == zero3[LEFT_OUT][name]["shape"]
        assert entry["fingerprint"] == pytest.approx(zero3[LEFT_OUT][name]["fingerprint"], rel=1e-12)
    sharded = root / "fsdp" / STEP_4
    weights = [name for name in FileSystemReader(str(sharded)).read_metadata().state_dict_metadata
               if name.startswith("state_dict.")]
    assert weights and all("lora_" in name for name in weights)
    assert len(torch.load(sharded / "meta.pt", weights_only=False)[LEFT_OUT]) == 51
    assert sorted(runs["zero3_resumed_ddp_s"]) == [5, 6]  # ZeRO-3 rounds the gradients through the bf16 base otherwise
    assert runs["zero3_resumed_ddp_s"][5] == pytest.approx(runs["ddp"][5], rel=5e-4)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_another_engine_resumes_the_zero_3_checkpoint_with_the_base_it_builds(runs, strategy):
    # ZeRO-3 rounds the gradients through the bf16 base otherwise than ddp and fsdp: the adapters' step-4 values so.
    resumed = runs[f"{strategy}_resumed"]
    assert sorted(resumed) == [5, 6]
    assert resumed[5] == pytest.approx(runs["zero3"][5], rel=5e-4)
    assert resumed == pytest.approx(runs["ddp_resumed"], rel=1e-6)


def test_a_model_built_on_other_weights_is_refused_in_one_line(runs):
    stderr = runs["other_base"]["stderr"]
    line = next(line for line in stderr.splitlines() if "CheckpointError: " in line)
    assert ("ckpt_path: the checkpoint left its frozen weights out (exclude_frozen_parameters=True) and the model as"
            " built holds others: model.base_model.model.lm_head.weight") in line
    assert "(of 51) differ from the ones it was saved with" in line
    assert "Trainer.fit` stopped" not in stderr


def test_load_from_checkpoint_takes_the_frozen_weights_from_the_module_it_builds(runs, pretrained_folders):
    import lightning_dist
    from tests.lora_checkpoint_script import LoraFineTune

    module = lightning_dist.load_from_checkpoint(LoraFineTune, runs["checkpoint"], trusted=True,
                                                 folder=str(pretrained_folders["qwen2"]))
    base = module.model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    from safetensors.torch import load_file

    pretrained = {}
    for shard in pretrained_folders["qwen2"].glob("*.safetensors"):
        pretrained.update(load_file(shard))
    assert torch.equal(base.float(), pretrained["model.layers.0.self_attn.q_proj.weight"].float())
    trained = module.model.base_model.model.model.layers[0].self_attn.q_proj.lora_B.default.weight
    assert trained.abs().max() > 0  # the adapters the run trained, off B = 0

    with pytest.raises(CheckpointError, match="the model as built holds others"):
        lightning_dist.load_from_checkpoint(LoraFineTune, runs["checkpoint"], trusted=True,
                                            folder=str(runs["checkpoint"].parents[2] / "other_qwen2"))


def test_fingerprints_add_up_in_chunks_and_name_what_differs(monkeypatch):
    import lightning_dist.checkpoints.frozen_weights as frozen_weights

    tensor = torch.randn(1000, dtype=torch.bfloat16)
    whole = fingerprint(tensor)
    monkeypatch.setattr(frozen_weights, "_CHUNK", 7)
    assert fingerprint(tensor) == pytest.approx(whole, rel=1e-12)
    assert whole[1] == pytest.approx(float(tensor.double().square().sum()), rel=1e-12)

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    model[0].requires_grad_(False)
    saved = frozen_fingerprints(model)
    assert saved == {"0.weight": {"shape": [3, 3], "fingerprint": fingerprint(model[0].weight)},
                     "0.bias": {"shape": [3], "fingerprint": fingerprint(model[0].bias)}}
    check_left_out(model, saved)
    with torch.no_grad():
        model[0].bias.add_(1e-3)
    with pytest.raises(CheckpointError, match=r"holds others: 0\.bias \(of 1\)"):
        check_left_out(model, saved)
    model[0].requires_grad_(True)  # unfrozen after the save (BackboneFinetuning): still the value it left out
    with pytest.raises(CheckpointError, match=r"holds others: 0\.bias \(of 1\)"):
        check_left_out(model, saved)
    with pytest.raises(CheckpointError, match=r"has no 1\.gate, 2\.weight \(of 2\)"):
        check_left_out(model, {**saved, "2.weight": saved["0.weight"], "1.gate": saved["0.bias"]})


def test_a_tied_frozen_weight_is_fingerprinted_and_left_out_under_each_of_its_names():
    from lightning_dist.checkpoints.frozen_weights import frozen_weights_out_of_state_dicts

    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(5, 3), "head": torch.nn.Linear(3, 5, bias=False),
                                 "adapter": torch.nn.Linear(3, 3)})
    model.head.weight = model.embed.weight  # tied, as transformers ties a head to its embedding
    model.embed.requires_grad_(False)
    assert [name for name, _ in model.named_parameters()] == ["embed.weight", "adapter.weight", "adapter.bias"]
    saved = frozen_fingerprints(model)
    assert sorted(saved) == ["embed.weight", "head.weight"] and saved["head.weight"] == saved["embed.weight"]
    with frozen_weights_out_of_state_dicts(model):  # as DeepSpeed's engine saves its module
        assert sorted(model.state_dict()) == ["adapter.bias", "adapter.weight"]
    assert sorted(model.state_dict()) == ["adapter.bias", "adapter.weight", "embed.weight", "head.weight"]


def test_a_whole_module_loads_around_the_weights_left_out_and_nothing_else_is_missed():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    saved = {name: torch.full_like(value, 7.0) for name, value in model.state_dict().items()}
    base = model[0].weight.detach().clone()
    load_around_left_out(model, {"state_dict": {k: v for k, v in saved.items() if k != "0.weight"},
                                 LEFT_OUT: {"0.weight": {}}}, strict=True)
    assert torch.equal(model[0].weight, base) and torch.equal(model[1].weight, saved["1.weight"])
    with pytest.raises(CheckpointError, match=r"has no weights for 1\.bias and weights this model has not: -"):
        load_around_left_out(model, {"state_dict": {k: v for k, v in saved.items() if k not in ("0.weight", "1.bias")},
                                     LEFT_OUT: {"0.weight": {}}}, strict=True)


def test_export_refuses_a_checkpoint_without_its_frozen_weights_in_one_line():
    from lightning_dist.models.export import hf_model_of

    left_out = {"model.embed.weight": {"shape": [8, 4], "fingerprint": [0.0, 0.0]}}
    saved = {"hyper_parameters": {"model_type": "llama"}, "state_dict": {}, LEFT_OUT: left_out}
    with pytest.raises(CheckpointError, match=r"left its frozen weights out \(exclude_frozen_parameters=True\)"):
        hf_model_of(saved, "ckpt")


def test_a_split_layer_s_frozen_parts_are_refused_before_any_rank_starts(monkeypatch):
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    import lightning_dist
    from lightning_dist.strategies.launcher import PreflightError

    strategy = lightning_dist.DeepSpeedStrategy(stage=3, expert_parallel_size=2, exclude_frozen_parameters=True)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    monkeypatch.setattr(trainer.strategy.launcher.launcher, "launch", lambda *args, **kwargs: pytest.fail("launched"))
    with pytest.raises(PreflightError, match=r"^strategy.exclude_frozen_parameters=true with strategy"
                                             r".expert_parallel_size=2: each rank holds part of the model there"):
        trainer.fit(BoringModel())
