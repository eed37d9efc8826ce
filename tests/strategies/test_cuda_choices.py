"""The CUDA path is the same code as the CPU one: with a CUDA accelerator mocked, check what each strategy picks.

What runs for real on a GPU is in tests/gpu/ (scripts/gpu_check.sh); these pin down the choices on every commit.
"""

import os

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.accelerators import CUDAAccelerator

from lightning_dist.parallel import dims as dims_module
from lightning_dist.strategies import PRESETS
from lightning_dist.strategies import deepspeed as deepspeed_module
from lightning_dist.strategies.deepspeed.engine import use_deepspeed_accelerator
from lightning_dist.strategies.torch import fsdp as fsdp_module
from tests.conftest import PRESET_NAMES, STRATEGY_NAMES

# Presets that keep state in host memory: their collectives on host tensors need gloo beside nccl.
HOST_STATE_PRESETS = {"fsdp_cpu_offload", "deepspeed_stage_2_offload", "deepspeed_stage_3_offload", "deepspeed_stage_3_offload_nvme"}


def expected_backend(name: str) -> str:
    return "cpu:gloo,cuda:nccl" if name in HOST_STATE_PRESETS else "nccl"

CUDA_DEVICES = [torch.device("cuda", 0), torch.device("cuda", 1)]


def play_local_rank(monkeypatch, rank: int):
    """This process plays local rank `rank` of two on a 2-GPU node; the environment is restored afterwards."""
    saved = dict(os.environ)
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setenv("NODE_RANK", "0")
    yield rank
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def rank_1_of_2(monkeypatch):
    yield from play_local_rank(monkeypatch, 1)


@pytest.fixture(params=[0, 1], ids=["rank0", "rank1"])
def each_rank_of_2(request, monkeypatch):
    yield from play_local_rank(monkeypatch, request.param)


def cuda_strategy(name: str):
    preset = PRESETS[name]
    strategy = preset.strategy(**preset.kwargs)
    strategy.accelerator = CUDAAccelerator()
    strategy.parallel_devices = CUDA_DEVICES
    strategy.cluster_environment = LightningEnvironment()
    strategy.set_world_ranks()
    return strategy


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_picks_nccl_with_gloo_for_host_state_and_the_local_ranks_gpu(name, rank_1_of_2):
    strategy = cuda_strategy(name)
    assert strategy.root_device == torch.device("cuda", 1)
    assert strategy._get_process_group_backend() == expected_backend(name)


@pytest.mark.parametrize("name", [name for name in PRESET_NAMES if name != "fsdp_tp_pp"])  # it needs 4 ranks or more
def test_every_preset_binds_the_local_ranks_gpu_before_the_process_group_starts(name, each_rank_of_2, restore_deepspeed_accelerator, monkeypatch):
    """Our own code calls torch.cuda.set_device(local rank), then Lightning's device set-up runs (recorded here:
    its CUDA checks need a GPU), and both come before the process group (NCCL binds a device when it starts)."""
    events = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: events.append(("set_device", torch.device(device))))
    monkeypatch.setattr(dims_module, "init_device_mesh", lambda *args, **kwargs: None)
    strategy = cuda_strategy(name)
    monkeypatch.setattr(strategy.accelerator, "setup_device", lambda device: events.append(("setup_device", device)))
    for method in ("setup_distributed", "_setup_distributed"):
        monkeypatch.setattr(strategy, method, lambda: events.append(("process_group", None)), raising=False)
    strategy._lightning_module = type("Module", (), {})()
    strategy.setup_environment()
    rank_device = torch.device("cuda", each_rank_of_2)
    assert events == [("set_device", rank_device), ("setup_device", rank_device), ("process_group", None)]


def test_a_deepspeed_file_with_cpu_offload_gets_gloo_beside_nccl(rank_1_of_2):
    strategy = deepspeed_module.DeepSpeedStrategy(config={"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    strategy.accelerator, strategy.parallel_devices, strategy.cluster_environment = CUDAAccelerator(), CUDA_DEVICES, LightningEnvironment()
    assert strategy._get_process_group_backend() == "cpu:gloo,cuda:nccl"
    strategy.base_config = {"zero_optimization": {"stage": 2}}
    assert strategy._get_process_group_backend() == "nccl"


def test_ddp_wraps_with_the_local_device_id(rank_1_of_2):
    assert cuda_strategy("ddp").determine_ddp_device_ids() == [1]


@pytest.mark.parametrize("name", [n for n in STRATEGY_NAMES if n.startswith("fsdp")])
def test_fsdp_builds_a_cuda_mesh_and_pins_offloaded_memory(name, rank_1_of_2, monkeypatch):
    calls = []
    monkeypatch.setattr(dims_module, "init_device_mesh", lambda *args, **kwargs: calls.append((args, kwargs)))
    strategy = cuda_strategy(name)
    strategy.parallel_dims.build_mesh(strategy.root_device.type)
    # Lightning's axes, as its ModelParallelStrategy names them: a configure_model written for it works here.
    assert calls == [(("cuda", (2, 1)), {"mesh_dim_names": ("data_parallel", "tensor_parallel")})]
    assert fsdp_module.offload_policy(strategy.cpu_offload, strategy.root_device).__dict__.get("pin_memory", False) is strategy.cpu_offload


def test_fsdp_pp_puts_the_pipeline_axis_outermost(rank_1_of_2, monkeypatch):
    calls = []
    monkeypatch.setattr(dims_module, "init_device_mesh", lambda *args, **kwargs: calls.append((args, kwargs)))
    strategy = cuda_strategy("fsdp_pp")
    strategy.parallel_dims.build_mesh(strategy.root_device.type)
    assert calls == [(("cuda", (2, 1, 1)), {"mesh_dim_names": ("pipeline_parallel", "data_parallel", "tensor_parallel")})]


def test_hybrid_shard_mesh_replicates_across_nodes(rank_1_of_2, monkeypatch):
    calls, mesh = [], type("Mesh", (), {})()  # a stand-in: the flattened meshes are kept with it
    monkeypatch.setattr(dims_module, "init_device_mesh", lambda *args, **kwargs: calls.append((args, kwargs)) or mesh)
    monkeypatch.setattr(dims_module, "flatten_mesh_dims", lambda *args: calls.append(args))
    strategy = fsdp_module.FSDPStrategy(sharding_strategy="HYBRID_SHARD")
    strategy.parallel_devices, strategy.cluster_environment, strategy.num_nodes = CUDA_DEVICES, LightningEnvironment(), 3
    strategy.parallel_dims.build_mesh(strategy.root_device.type)
    assert calls == [
        (("cuda", (3, 2, 1)), {"mesh_dim_names": ("data_parallel_replicate", "data_parallel_shard", "tensor_parallel")}),
        (mesh, ("data_parallel_replicate", "data_parallel_shard"), "data_parallel"),
    ]


@pytest.fixture
def restore_deepspeed_accelerator():
    from deepspeed.accelerator import get_accelerator, set_accelerator

    saved = get_accelerator()
    yield
    set_accelerator(saved)


@pytest.mark.parametrize("name", [n for n in STRATEGY_NAMES if n.startswith("deepspeed")])
def test_deepspeed_uses_cuda_accelerator_nccl_and_device_index(name, rank_1_of_2, restore_deepspeed_accelerator, monkeypatch):
    import deepspeed

    calls = []
    monkeypatch.setattr(deepspeed, "init_distributed", lambda backend, **kwargs: calls.append(backend))
    strategy = cuda_strategy(name)
    assert use_deepspeed_accelerator(strategy.root_device) == "cuda"
    assert os.environ["DS_ACCELERATOR"] == "cuda"
    strategy.setup_distributed()  # validates device indices against local ranks, as on a real node
    assert calls == [expected_backend(name)]
    assert strategy.root_device.index == 1  # what deepspeed.initialize gets as device_rank


@pytest.mark.parametrize("name", sorted(HOST_STATE_PRESETS))
def test_host_state_presets_use_plain_gloo_on_cpu(name, rank_1_of_2):
    preset = PRESETS[name]
    strategy = preset.strategy(**preset.kwargs)
    strategy.parallel_devices, strategy.cluster_environment = [torch.device("cpu")] * 2, LightningEnvironment()
    assert strategy._get_process_group_backend() == "gloo"


def test_deepspeed_on_cpu_gives_each_rank_an_index(rank_1_of_2, restore_deepspeed_accelerator):
    strategy = deepspeed_module.DeepSpeedStrategy(stage=2)
    strategy.parallel_devices = [torch.device("cpu")] * 2
    strategy.cluster_environment = LightningEnvironment()
    assert strategy.root_device == torch.device("cpu", 1)
    assert use_deepspeed_accelerator(strategy.root_device) == "cpu"
    assert strategy._get_process_group_backend() == "gloo"
