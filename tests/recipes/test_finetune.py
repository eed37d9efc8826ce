"""recipes/finetune as its README types it, from one fresh working directory: a "pretrained" folder made, fine-tuned
whole under fsdp and ZeRO-3, then with LoRA under both; the adapters written whole; the merged export and the
adapters on the pretrained folder give the same logits and the same generated tokens."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import REPO, documented_commands, run_documented

pytestmark = pytest.mark.slow

RECIPE = REPO / "recipes" / "finetune" / "README.md"
STEPS = "trainer.max_steps=3"


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory, deepspeed_ops):
    """Every command of the page, in order, in one directory (recipes/ beside it, as in a clone's root)."""
    cwd = tmp_path_factory.mktemp("finetune")
    (cwd / "recipes").symlink_to(REPO / "recipes")
    outputs = {}
    for command in documented_commands(RECIPE):
        typed = f"{command} {STEPS}" if command.startswith("python train.py") else command
        process = run_documented(typed, cwd)
        assert process.returncode == 0, f"{command}\n{process.stderr[-3000:]}"
        outputs[command] = process.stdout
    runs = sorted((cwd / "logs" / "train" / "runs").iterdir())
    return cwd, runs, outputs


def test_each_command_ran_and_each_run_trained_from_the_folder(recipe_run):
    cwd, runs, outputs = recipe_run
    assert len(documented_commands(RECIPE)) == 8 and len(runs) == 4
    strategies = [json.loads((run / "metrics.json").read_text())["strategy"] for run in runs]
    assert strategies == ["FSDPStrategy", "DeepSpeedStrategy", "DeepSpeedStrategy", "FSDPStrategy"]
    assert [(run / "adapters" / "adapter_model.safetensors").exists() for run in runs] == [False, False, True, True]


@pytest.mark.parametrize("run_index", [2, 3], ids=["deepspeed_stage_3", "fsdp"])
def test_the_adapters_are_written_whole(recipe_run, run_index):
    from safetensors.torch import load_file

    _, runs, _ = recipe_run
    adapters = load_file(runs[run_index] / "adapters" / "adapter_model.safetensors")
    config = json.loads((runs[run_index] / "adapters" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and config["peft_type"] == "LORA"
    # q_proj (64 -> 64) in each of the 4 layers: A is r x 64, B 64 x r, whole (not a rank's shard).
    q_a = [t for name, t in adapters.items() if name.endswith("self_attn.q_proj.lora_A.weight")]
    q_b = [t for name, t in adapters.items() if name.endswith("self_attn.q_proj.lora_B.weight")]
    assert [tuple(t.shape) for t in q_a] == [(8, 64)] * 4 and [tuple(t.shape) for t in q_b] == [(64, 8)] * 4
    assert all(t.abs().max() > 0 for t in q_b)  # trained off B = 0


def test_the_merged_export_is_the_pretrained_model_with_the_adapters(recipe_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import lightning_dist

    cwd, runs, outputs = recipe_run
    merged = AutoModelForCausalLM.from_pretrained(cwd / "merged", dtype=torch.float32).eval()
    adapted = PeftModel.from_pretrained(lightning_dist.from_pretrained(cwd / "pretrained" / "llama"),
                                        runs[-1] / "adapters").eval()
    assert not any("lora" in name for name, _ in merged.named_parameters())
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    # `lightning-dist generate` from the folder with the adapters, then from the merged export: the same 24 bytes.
    generated = [out for command, out in outputs.items() if command.startswith("lightning-dist generate")]
    assert len(generated) == 2 and generated[0] == generated[1] and generated[0].startswith("The ")
    assert len(generated[0].removesuffix("\n")) >= len("The ") + 24 // 4  # 24 bytes: 6 characters or more
