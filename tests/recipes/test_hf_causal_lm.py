"""recipes/hf_causal_lm at tiny size: a transformers GPT-2 and BART, built from their configs (the package's
`model=hf_gpt2`, `model=hf_bart`), trained through `train.py` under several presets on 2 CPU ranks; a checkpoint
exported as a `save_pretrained` folder (`lightning-dist export`), and text generated from both."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
import transformers  # the hf extra: the README's test command installs it

from lightning_dist.checkpoints.consolidate import load_consolidated
from lightning_dist.reports.equivalence import run_strategy
from tests.conftest import in_the_suite

pytestmark = pytest.mark.slow

SHORT = ("trainer.max_steps=4", "trainer.num_sanity_val_steps=0")
GPT2_PRESETS = ["ddp", "fsdp", "fsdp_activation_checkpointing", "deepspeed_stage_2", "deepspeed_stage_3_offload"]


@pytest.fixture(scope="module")
def gpt2_runs(tmp_path_factory, deepspeed_ops):
    """{preset: its run of GPT-2}, each made on first use."""
    workdir = tmp_path_factory.mktemp("hf_gpt2")

    class Runs(dict):
        def __missing__(self, name: str):
            self[name] = run_strategy(name, [*SHORT, "model=hf_gpt2"], workdir / name)
            return self[name]

    return Runs()


@pytest.mark.parametrize("name", in_the_suite(GPT2_PRESETS[1:], ["deepspeed_stage_3_offload"]))
def test_gpt2_trains_under_each_preset_as_under_ddp(gpt2_runs, name):
    reference, run = gpt2_runs["ddp"], gpt2_runs[name]
    assert (reference.returncode, run.returncode) == (0, 0)
    assert sorted(run.losses) == [0, 1, 2, 3]
    assert run.losses[3] < run.losses[0]
    for step, loss in reference.losses.items():
        assert run.losses[step] == pytest.approx(loss, rel=1e-5), step


@pytest.fixture(scope="module")
def exported(gpt2_runs, tmp_path_factory):
    from lightning_dist.models.export import main as export

    checkpoint = gpt2_runs["deepspeed_stage_3_offload"].run_dir / "checkpoints" / "last.ckpt"
    folder = tmp_path_factory.mktemp("exported") / "gpt2"
    assert export([str(checkpoint), str(folder)]) == 0
    return checkpoint, folder


def test_export_loads_with_from_pretrained_tied_and_with_the_same_logits(exported, capsys):
    from lightning_dist.models.export import main as export
    from lightning_dist.models.hf_language_model import HFLanguageModel

    checkpoint, folder = exported
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    saved = load_consolidated(checkpoint)
    trained = HFLanguageModel(**saved["hyper_parameters"])
    trained.load_state_dict(saved["state_dict"])
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        difference = (model(input_ids=tokens).logits - trained.eval()(tokens)).abs().max().item()
    assert difference <= 1e-5
    assert model.lm_head.weight is model.transformer.wte.weight
    assert not torch.equal(model.lm_head.weight, HFLanguageModel(**saved["hyper_parameters"]).model.lm_head.weight)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in folder.iterdir())
    assert export([str(checkpoint), str(folder)]) == 2  # nothing there is overwritten, in one line
    assert capsys.readouterr().err == f"error: out_dir: {folder} is not empty; pass a new folder (nothing there is overwritten)\n"
    assert sorted((p.name, p.stat().st_mtime_ns) for p in folder.iterdir()) == before


def test_the_checkpoint_and_its_export_write_the_same_text(exported, capsys):
    from lightning_dist.models.generate import main as generate
    from lightning_dist.models.hf_language_model import HFLanguageModel

    checkpoint, folder = exported
    said = {}
    for path in (checkpoint, folder):
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            assert generate([str(path), "--prompt", "def ", "--tokens", "12"]) == 0
        said[path] = printed.getvalue()
    assert said[checkpoint] == said[folder] and said[folder].startswith("def ")
    # The trained weights' likeliest byte after each, by hand: what both wrote.
    saved = load_consolidated(checkpoint)
    trained = HFLanguageModel(**saved["hyper_parameters"])
    trained.load_state_dict(saved["state_dict"])
    tokens = torch.tensor([list(b"def ")])
    with torch.no_grad():
        for _ in range(12):
            tokens = torch.cat([tokens, trained.eval()(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert said[folder] == bytes(tokens[0].tolist()).decode(errors="replace") + "\n"
    assert generate([str(folder), "--prompt", "def ", "--tokens", "200"]) == 2  # past GPT-2's 128 positions
    assert capsys.readouterr().err == ("error: --tokens: the model reads at most 128 positions (its config's"
                                       " max_position_embeddings), and the prompt's 4 tokens and 200 new ones are"
                                       " more; ask for at most 124\n")


def test_pretrained_weights_are_what_a_sharding_preset_starts_from(gpt2_runs, exported, tmp_path):
    # Built on the meta device and initialised afresh, they would be lost: the step-0 loss shows which weights ran.
    pretrained = ["model=hf_gpt2", f"model.pretrained={exported[1]}", "trainer.max_steps=1"]
    runs = {name: run_strategy(name, pretrained, tmp_path / name) for name in ("ddp", "fsdp")}
    assert runs["fsdp"].losses == pytest.approx(runs["ddp"].losses, rel=1e-6)
    assert runs["ddp"].losses[0] < 0.9 * gpt2_runs["ddp"].losses[0]  # trained weights, not a fresh draw


def test_bart_checkpoints_both_stacks_under_fsdp(tmp_path, deepspeed_ops):
    runs = {name: run_strategy(name, [*SHORT, "model=hf_bart"], tmp_path / name) for name in ("ddp", "fsdp_activation_checkpointing")}
    checkpointed = runs["fsdp_activation_checkpointing"]
    assert checkpointed.returncode == 0
    placement = json.loads((checkpointed.run_dir / "metrics.json").read_text())["placement_per_rank"]
    # Two BartEncoderLayers and two BartDecoderLayers: each checkpointed and an FSDP unit, then the root.
    assert [(rank["checkpointed_blocks"], rank["fsdp_units"]) for rank in placement] == [(4, 5), (4, 5)]
    for step, loss in runs["ddp"].losses.items():
        assert checkpointed.losses[step] == pytest.approx(loss, rel=1e-5), step
