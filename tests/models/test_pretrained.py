"""Weights that exist are never replaced by sharded initialisation, and a `save_pretrained` folder loads tensor by
tensor into a model built on the meta device (lightning_dist.from_pretrained), in process: no ranks."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

import lightning_dist
from lightning_dist.parallel.pretrained_weights import PretrainedFolder
from lightning_dist.parallel.sharded_init import give_memory, initialize_parameters, parameters_on_meta


def as_float32(folder) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()


def test_from_pretrained_inside_meta_construction_keeps_the_loaded_weights(pretrained_folders):
    # What configure_model and trainer.init_module() run in under fsdp and ZeRO-3: transformers builds the model
    # empty and then sets each loaded weight, which must not go to the meta device.
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_pretrained(pretrained_folders["llama"], dtype=torch.float32)
    assert not any(p.is_meta for p in model.parameters())
    for name, value in as_float32(pretrained_folders["llama"]).items():
        assert torch.equal(model.state_dict()[name], value), name


def test_a_constructors_parameters_still_go_to_the_meta_device():
    with parameters_on_meta():
        layer = nn.Linear(3, 3)
        layer.extra = nn.Parameter(torch.ones(3))  # given after construction: a value that exists
    assert layer.weight.is_meta and layer.bias.is_meta
    assert not layer.extra.is_meta and torch.equal(layer.extra, torch.ones(3))


def test_load_state_dict_into_a_model_built_on_meta_takes_the_values(pretrained_folders):
    folder = pretrained_folders["qwen2"]
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    assert all(p.is_meta for p in model.parameters())
    state = {}
    for shard in sorted(folder.glob("*.safetensors")):
        state.update(load_file(shard))
    model.load_state_dict(state, strict=False)  # the tied head is saved once, as the embedding
    assert not any(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for name, value in as_float32(folder).items():
        assert torch.equal(model.state_dict()[name], value), name


def test_peft_adapters_on_a_meta_base_start_from_peft_s_initial_values(pretrained_folders):
    folder = pretrained_folders["llama"]
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    torch.manual_seed(3)
    eager = get_peft_model(lightning_dist.from_pretrained(folder), lora)
    torch.manual_seed(3)
    with parameters_on_meta():
        deferred = get_peft_model(lightning_dist.from_pretrained(folder), lora)
    assert all(p.is_meta for p in deferred.parameters())  # PEFT moves its adapters to the base layer's device
    initialize_parameters(deferred, give_memory, seed=11, params=list(deferred.parameters()))
    adapters = {n: p for n, p in deferred.named_parameters() if "lora_" in n}
    assert len(adapters) == 16
    for name, value in deferred.state_dict().items():
        assert torch.equal(value, eager.state_dict()[name]), name  # the base read, the adapters PEFT's own draws
    assert not any(value.any() for name, value in adapters.items() if "lora_B" in name)  # B = 0


def test_an_adapter_never_seen_with_values_is_refused_not_drawn(pretrained_folders):
    with parameters_on_meta():
        base = lightning_dist.from_pretrained(pretrained_folders["llama"])
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"]))  # on meta, outside the context
    with pytest.raises(ValueError, match=r"^model: .*lora_A.default is an adapter of PEFT's Linear on the meta"
                                         r" device, whose initial values \(LoRA's B = 0\) were never seen"):
        initialize_parameters(model, give_memory, params=[p for p in model.parameters() if p.is_meta])


# Mixtral's folder holds each expert's w1, w2, w3 under `block_sparse_moe` (the Hub's layout), its model the
# experts fused under `mlp`: read as transformers' own from_pretrained reads them.
@pytest.mark.parametrize("model", ["llama", "qwen2", "mixtral"])
def test_from_pretrained_reads_the_folder_into_the_run_s_dtype(pretrained_folders, model):
    folder = pretrained_folders[model]
    loaded = lightning_dist.from_pretrained(folder)  # eager: no strategy builds it empty here
    expected = as_float32(folder)
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}  # the folder holds bf16
    assert sorted(loaded.state_dict()) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(loaded.state_dict()[name], value), name
    tied = loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert tied == (model == "qwen2")
    as_saved = lightning_dist.from_pretrained(folder, dtype="auto")  # the folder's bf16, as transformers reads it
    assert {p.dtype for p in as_saved.parameters()} == {torch.bfloat16}
    for name, value in expected.items():
        assert torch.equal(as_saved.state_dict()[name].float(), value), name


@pytest.mark.parametrize("model", ["qwen2", "mixtral"])
def test_under_sharded_initialisation_each_value_is_read_not_drawn(pretrained_folders, model):
    folder = pretrained_folders[model]
    with parameters_on_meta():
        model = lightning_dist.from_pretrained(folder)
    assert all(p.is_meta for p in model.parameters())
    kept = []
    initialize_parameters(model, lambda p, full: (kept.append(full.shape), give_memory(p, full)), seed=5,
                          params=list(model.parameters()))
    assert len(kept) == len(list(model.parameters()))  # one full tensor at a time, the tied one once
    for name, value in as_float32(folder).items():
        assert torch.equal(model.state_dict()[name], value), name


@pytest.mark.parametrize("model", ["llama", "mixtral"])
def test_a_rank_that_keeps_rows_of_each_weight_reads_those_rows_alone(pretrained_folders, model, monkeypatch):
    # FSDP's shards are rows of each weight: the file is read by the region a rank keeps, so that no rank holds a
    # whole tensor it does not keep (BENCHMARKS.md, "Loading a pretrained model"). A tensor made from several
    # (Mixtral's experts, one per file entry) is made whole and then cut.
    folder = pretrained_folders[model]
    reads = []
    plain_read = PretrainedFolder.read
    monkeypatch.setattr(PretrainedFolder, "read", lambda self, name, dtype, region=None: (
        reads.append((name, region)), plain_read(self, name, dtype, region))[1])
    with parameters_on_meta():
        built = lightning_dist.from_pretrained(folder)
    rows = (slice(1, 3),)
    kept = {}
    names = {id(p): name for name, p in built.named_parameters()}
    initialize_parameters(built, lambda p, part: kept.setdefault(names[id(p)], part), seed=5,
                          params=list(built.parameters()), region=lambda p: rows if p.dim() > 1 else None)
    expected = as_float32(folder)
    assert len(kept) == len(list(built.parameters()))
    for name, part in kept.items():
        assert torch.equal(part, expected[name][rows] if expected[name].dim() > 1 else expected[name]), name
    whole = [name for name, region in reads if region is None and name.endswith(".weight")
             and "norm" not in name and "experts" not in name]
    assert not whole  # every matrix read by its rows, the experts' excepted
    assert ("experts" in str(reads)) == (model == "mixtral")


def test_a_folder_that_is_not_the_model_s_is_refused_naming_the_first_mismatches(pretrained_folders):
    folder = pretrained_folders["llama"]
    deeper = AutoConfig.from_pretrained(folder, num_hidden_layers=5, vocab_size=300)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(deeper)
    with pytest.raises(ValueError) as refused:
        PretrainedFolder(folder, "model.pretrained").attach(model)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"model.pretrained={folder}: its weights are not LlamaForCausalLM's: missing"
                              " model.layers.4.self_attn.q_proj.weight, model.layers.4.self_attn.k_proj.weight,"
                              " model.layers.4.self_attn.v_proj.weight (and 6 more); shape model.embed_tokens.weight"
                              " (256, 64) in the folder, (300, 64) in the model")
    with pytest.raises(FileNotFoundError, match=r"^model.pretrained=.*: no model.safetensors or"
                                                r" model.safetensors.index.json there"):
        PretrainedFolder(folder.parent, "model.pretrained")


def test_a_mixture_of_experts_folder_with_other_experts_is_refused_naming_the_fused_tensor(pretrained_folders):
    folder = pretrained_folders["mixtral"]  # 4 experts, each its own w1, w2, w3
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, num_local_experts=5))
    with pytest.raises(ValueError) as refused:
        PretrainedFolder(folder, "model.pretrained").attach(model)
    assert str(refused.value) == (
        f"model.pretrained={folder}: its weights are not MixtralForCausalLM's: shape"
        " model.layers.0.block_sparse_moe.gate.weight (4, 64) in the folder, (5, 64) in the model,"
        " model.layers.0.block_sparse_moe.experts.0.w1.weight (+7 more made into one) (4, 256, 64) in the folder,"
        " (5, 256, 64) in the model, model.layers.0.block_sparse_moe.experts.0.w2.weight (+3 more made into one)"
        " (4, 64, 128) in the folder, (5, 64, 128) in the model (and 9 more)")



def test_a_region_read_from_the_file_is_that_region_of_the_tensor(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    saved = {"bf16": torch.randn(7, 5).to(torch.bfloat16), "vector": torch.randn(6), "ids": torch.arange(12).view(3, 4),
             "cube": torch.randn(4, 3, 2)}
    save_file(saved, tmp_path / "model.safetensors")
    folder = PretrainedFolder(tmp_path)
    cases = [("bf16", (slice(2, 5),)), ("bf16", (slice(0, 7), slice(1, 3))), ("vector", (slice(1, 4),)),
             ("ids", (slice(1, 3), slice(0, 4))), ("cube", (slice(3, 4),)), ("bf16", (slice(7, 7),)), ("cube", None)]
    for name, region in cases:
        expected = saved[name] if region is None else saved[name][region]
        value = folder.read(name, torch.float32, region)
        assert torch.equal(value, expected.float() if expected.is_floating_point() else expected), (name, region)
        assert value.dtype == (torch.int64 if name == "ids" else torch.float32)


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory):
    """A GPT-OSS folder as OpenAI publishes the model (experts in MXFP4, 4 shards), and what MXFP4 holds of its
    experts."""
    from transformers import GptOssConfig, GptOssForCausalLM

    from tests.models.mxfp4_folder import write_mxfp4_folder

    root = tmp_path_factory.mktemp("gpt_oss")
    torch.manual_seed(0)
    GptOssForCausalLM(GptOssConfig(vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                   num_experts_per_tok=2)).to(torch.bfloat16).save_pretrained(
        root / "bf16", max_shard_size="60KB")
    values = write_mxfp4_folder(root / "bf16", root / "mxfp4")
    return root / "mxfp4", values


def test_gpt_oss_s_mxfp4_experts_are_read_unpacked_as_transformers_dequantizes_them(gpt_oss_mxfp4, tmp_path):
    """OpenAI's GPT-OSS checkpoints hold the experts in MXFP4: refused before as not the model's weights ("missing
    ...experts.gate_up_proj; unexpected ...gate_up_proj_blocks"). Read unpacked, they are the weights transformers'
    own from_pretrained gives with Mxfp4Config(dequantize=True), and the model (and what it saves) is a plain one."""
    from transformers import GptOssForCausalLM, Mxfp4Config

    folder, values = gpt_oss_mxfp4
    assert len(list(folder.glob("*.safetensors"))) == 4 and len(values) == 4  # 2 layers' gate_up_proj, down_proj
    expected = GptOssForCausalLM.from_pretrained(folder, quantization_config=Mxfp4Config(dequantize=True),
                                                 dtype=torch.float32).state_dict()
    loaded = lightning_dist.from_pretrained(folder)
    assert sorted(loaded.state_dict()) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(loaded.state_dict()[name], value), name
    for name, value in values.items():  # what the test's own unpacking of each 4-bit value and scale gives
        assert torch.equal(loaded.state_dict()[name], value.float()), name
    assert getattr(loaded.config, "quantization_config", None) is None
    loaded.save_pretrained(tmp_path / "saved")
    assert torch.equal(load_file(next((tmp_path / "saved").glob("*.safetensors")))[
        "model.layers.0.mlp.experts.down_proj"], expected["model.layers.0.mlp.experts.down_proj"])


def test_a_rank_reads_the_mxfp4_blocks_of_its_own_experts_alone(gpt_oss_mxfp4):
    folder, values = gpt_oss_mxfp4
    weights = PretrainedFolder(folder)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert weights.shapes[name] == (4, 64, 64) and f"{name}_blocks" not in weights.shapes
    for region in [(slice(1, 3),), (slice(3, 4), slice(8, 40)), None]:
        expected = values[name].float() if region is None else values[name].float()[region]
        assert torch.equal(weights.read(name, torch.float32, region), expected), region
    with parameters_on_meta():
        model = lightning_dist.from_pretrained(folder)
    rows = (slice(2, 4),)  # an FSDP shard of 2 ranks: experts 2 and 3
    names = {id(p): name for name, p in model.named_parameters()}
    kept = {}
    initialize_parameters(model, lambda p, part: kept.setdefault(names[id(p)], part), seed=5,
                          params=list(model.parameters()), region=lambda p: rows if p.dim() > 1 else None)
    assert torch.equal(kept[name], values[name].float()[rows])


def test_a_folder_quantized_otherwise_is_refused_naming_its_method(pretrained_folders, tmp_path):
    import json
    import shutil

    folder = tmp_path / "fp8"
    shutil.copytree(pretrained_folders["llama"], folder)
    shard = next(folder.glob("*.safetensors"))
    tensors = load_file(shard)
    name = next(name for name in tensors if name.endswith("q_proj.weight"))
    tensors[f"{name}_scale_inv"] = torch.ones(1)  # DeepSeek-V3's fp8 checkpoints keep a scale beside each weight
    from safetensors.torch import save_file

    save_file(tensors, shard, metadata={"format": "pt"})
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"][f"{name}_scale_inv"] = shard.name
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config))
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(pretrained_folders["llama"]))
    with pytest.raises(ValueError) as refused:
        PretrainedFolder(folder, "model.pretrained").attach(model)
    assert str(refused.value) == (
        f"model.pretrained={folder}: its weights are quantized (fp8: quantization_config.quant_method in its"
        " config.json), which lightning_dist reads only unpacked from mxfp4; save them unquantized first"
        " (transformers' from_pretrained with the quantizer's dequantize option, then save_pretrained)")
