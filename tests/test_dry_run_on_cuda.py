"""The dry run with CUDA faked (no GPU here): every preset's set-up and steps on `cuda:<local rank>` at 8 ranks,
with the device check that a CPU run cannot make; and three device bugs it finds, one at a time."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lightning_dist.dry_run import can_dry_run, dry_run_configured, dry_run_devices
from tests.conftest import REPO
from tests.dry_run_bugs import dry_run_each

CONF = REPO / "lightning_dist" / "conf"

MODEL = {"_target_": "tests.dry_run_bugs.BuggyGPT", "vocab_size": 256, "block_size": 64, "n_layer": 2}
BATCH = (torch.zeros(2, 64, dtype=torch.long), torch.zeros(2, 64, dtype=torch.long))


def dry_run(bug: str | None, rank: int = 5) -> list:
    device_type, run, where = dry_run_devices("gpu", 8)
    assert (device_type, where) == ("cuda", "on fake CUDA devices (this machine has none)")
    strategy = {"_target_": "lightning_dist.strategies.FSDPStrategy"}
    return run(dry_run_configured, strategy, {**MODEL, "bug": bug}, BATCH, "bf16-mixed", 8, 1, (rank,), "cuda")


def test_a_correct_model_passes_on_its_own_device():
    (view,) = dry_run(None)
    assert view.coordinate == {"data_parallel": 5, "tensor_parallel": 0}
    assert view.peak["SHARDED_PARAM"] > 0 and view.peak["ACT"] > 0


# How each torch release words a device mismatch (.ci/compat_tier): an op's and a collective's; the second device's
# case (the same op's check) in the main suite only, 24 s of each tier on CI.
ON_EVERY_TORCH = pytest.mark.compat


@pytest.mark.parametrize(("bug", "message"), [
    pytest.param("host_positions", "rank 5: aten.embedding.default was given tensors on cuda:5 and cpu",
                 marks=ON_EVERY_TORCH),
    ("device_0_positions", "rank 5: aten.embedding.default was given tensors on cuda:5 and cuda:0"),
    pytest.param("host_count_gathered", "rank 5: the collective c10d.allgather_.default was given a tensor on cpu;"
                 " this rank's collectives send tensors on cuda:5", marks=ON_EVERY_TORCH),
])
def test_each_device_bug_is_named_with_its_op_and_both_devices(bug, message):
    from lightning_dist._compat.fake_cuda import FakeCudaRunFailed

    with pytest.raises(FakeCudaRunFailed) as failure:
        dry_run(bug)
    assert str(failure.value).startswith(f"DeviceMismatch: {message}"), failure.value.child_traceback[-2000:]


def preset_runs(rank: int) -> dict[str, tuple]:
    """Every preset a dry run knows, composed as `train.py strategy=NAME trainer=gpu trainer.devices=8` composes
    it, on the default model: `dry_run_configured`'s arguments for `rank` of 8."""
    from hydra.utils import instantiate

    runs = {}
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for path in sorted((CONF / "strategy").glob("*.yaml")):
            cfg = compose("train", overrides=[f"strategy={path.stem}", "trainer=gpu", "trainer.devices=8"])
            strategy = OmegaConf.to_container(cfg.strategy, resolve=True)
            if path.stem == "auto_fit" or not can_dry_run(instantiate(strategy)):
                continue
            model = OmegaConf.to_container(cfg.model, resolve=True)
            model.pop("block_class", None)
            runs[path.stem] = (strategy, {k: v for k, v in model.items() if k not in ("optimizer", "scheduler")},
                               BATCH, cfg.trainer.precision, 8, 1, (rank,), "cuda")
    return runs


@pytest.fixture(scope="module")
def every_preset_on_rank_7():
    runs = preset_runs(7)
    device_type, run, _ = dry_run_devices("gpu", 8)
    return runs, run(dry_run_each, runs)


def test_every_preset_runs_on_its_rank_s_own_device(every_preset_on_rank_7):
    runs, views = every_preset_on_rank_7
    assert sorted(views) == ["ddp", "deepspeed", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_2_offload",
                             "deepspeed_stage_3", "deepspeed_stage_3_offload", "deepspeed_stage_3_offload_nvme",
                             "fsdp", "fsdp_activation_checkpointing", "fsdp_cpu_offload", "fsdp_pp",
                             "fsdp_shard_grad_op", "fsdp_tp", "fsdp_tp_pp", "hsdp_tp"]
    for name, (view,) in views.items():
        assert view.rank == 7 and view.peak["Total"] > 0, name
    assert views["ddp"][0].coordinate["data_parallel_replicate"] == 7
    assert views["fsdp"][0].coordinate == {"data_parallel": 7, "tensor_parallel": 0}
    assert views["fsdp_tp"][0].coordinate == {"data_parallel": 3, "tensor_parallel": 1}
    # Rank 7 runs the last pipeline stage: its blocks, the final norm and the head, each op on its own device.
    assert views["fsdp_pp"][0].coordinate == {"pipeline_parallel": 1, "data_parallel": 3, "tensor_parallel": 0}
    assert views["fsdp_tp_pp"][0].coordinate == {"pipeline_parallel": 1, "data_parallel": 1, "tensor_parallel": 1}
    assert {name.split(".")[1] for name, *_ in views["fsdp_pp"][0].shards} == {"blocks", "ln_out", "lm_head"}


def test_offloaded_state_is_on_the_host_and_the_rest_on_the_device(every_preset_on_rank_7):
    _, views = every_preset_on_rank_7
    (offloaded,), (resident,) = views["fsdp_cpu_offload"], views["fsdp"]
    assert offloaded.host > 0 and resident.host == 0
    assert offloaded.peak.get("SHARDED_PARAM", 0) == 0 and offloaded.peak.get("OPT", 0) == 0
    assert resident.peak["SHARDED_PARAM"] > 0 and resident.peak["OPT"] > 0


# The default model's parameters; its master weights and Adam's two moments are 12 bytes of each, per rank.
PARAMETERS = 875_264
OPTIMIZER_STATE = PARAMETERS // 8 * 12


def test_zero_keeps_what_each_stage_says_where_deepspeed_puts_it(every_preset_on_rank_7):
    _, views = every_preset_on_rank_7
    peak = {name: view.peak for name, (view,) in views.items()}
    host = {name: view.host for name, (view,) in views.items()}
    for name in ("deepspeed_stage_1", "deepspeed_stage_2"):  # whole bf16 weights; a shard of fp32 state, padded
        assert peak[name]["PARAM"] == PARAMETERS * 2 and "SHARDED_PARAM" not in peak[name], name
        assert 0 <= peak[name]["OPT"] - OPTIMIZER_STATE <= 3 * 4 * 512, name
        # Two of Lightning's 2e8-element gradient buckets in bf16, whatever the model's size (as the plan counts).
        assert peak[name]["ENGINE_BUFFERS"] >= 2 * 200_000_000 * 2, name
    # ZeRO-3: an eighth of every bf16 weight and gradient, kept between uses; gathered for a block at a time.
    assert abs(peak["deepspeed_stage_3"]["SHARDED_PARAM"] - PARAMETERS * 2 / 8) <= 2 * 512
    assert abs(peak["deepspeed_stage_3"]["SHARDED_GRAD"] - PARAMETERS * 2 / 8) <= 2 * 512
    assert peak["deepspeed_stage_3"]["ENGINE_BUFFERS"] < 1e6 and host["deepspeed_stage_3"] < 100
    for name in ("deepspeed_stage_2_offload", "deepspeed_stage_3_offload", "deepspeed_stage_3_offload_nvme"):
        # The optimizer's state and step on the host (NVMe traced as host memory); none of it on the device.
        assert peak[name].get("OPT", 0) == 0 and host[name] >= OPTIMIZER_STATE, name
    assert peak["deepspeed_stage_3_offload"].get("SHARDED_PARAM", 0) == 0


def test_a_device_bug_ends_the_command_in_one_line_naming_op_and_devices(tmp_path):
    import subprocess
    import sys

    process = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "dry_run=true", "trainer=gpu", "trainer.devices=8",
         "dry_run_ranks=[5]", "model._target_=tests.dry_run_bugs.BuggyGPT", "+model.bug=host_positions"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert process.returncode == 2, process.stderr[-3000:]
    assert process.stderr.strip().splitlines()[-1] == (
        "error: dry_run=true found a device mismatch: rank 5: aten.embedding.default was given tensors on cuda:5 and"
        " cpu; a GPU run fails here the same way")


def test_where_cuda_cannot_be_faked_the_dry_run_says_why_and_uses_cpu_fakes():
    device_type, run, where = dry_run_devices("gpu", 16)
    assert device_type == "cpu"
    assert where == "on fake CPU devices: CUDA cannot be faked here (16 devices per node; CUDA is faked for 1 to 8)"
    assert dry_run_devices("cpu", 8)[::2] == ("cpu", "on fake CPU devices")


def test_the_documented_python_api_runs_as_typed_from_a_fresh_directory(tmp_path):
    import re
    import subprocess
    import sys

    page = (REPO / "docs" / "memory.md").read_text()
    (code,) = [block for block in re.findall(r"```python\n(.*?)```", page, re.S) if "dry_run(" in block]
    process = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert process.returncode == 0, process.stderr[-3000:]
    first, last = process.stdout.splitlines()
    assert first.startswith("0 {'data_parallel': 0, 'tensor_parallel': 0} ") and first.endswith(" MB")
    assert last.startswith("63 {'data_parallel': 63, 'tensor_parallel': 0} ")
    assert first.split("} ")[1] == last.split("} ")[1]  # every rank holds the same
