"""Each preset exists twice, as a registered Lightning name and as a Hydra option; both must build the same thing."""

import pickle
import subprocess
import sys

import lightning as L
import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from lightning.pytorch.strategies import StrategyRegistry

import lightning_dist  # noqa: F401  (registers the presets)
from lightning_dist.parallel.sizes import ParallelSizes
from lightning_dist.strategies import PRESETS, REGISTRY_PREFIX, DeepSpeedStrategy, FSDPStrategy
from tests.conftest import CONF_DIR, PRESET_NAMES, REPO

# What distinguishes one preset from another, read off a built strategy.
OBSERVED = {
    FSDPStrategy: lambda s: (s.sharding_strategy, s.activation_checkpointing, s.cpu_offload, s.parallel_sizes),
    DeepSpeedStrategy: lambda s: (s.config["zero_optimization"]["stage"], s.config["zero_optimization"].get("offload_optimizer", {}).get("device"), s.config["zero_optimization"].get("offload_param", {}).get("device")),
}


def test_every_preset_has_a_hydra_option_and_vice_versa():
    assert sorted(PRESETS) == PRESET_NAMES


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_yaml_and_registered_name_build_the_same_strategy(name):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"strategy={name}"])
    from_yaml = instantiate(cfg.strategy, _convert_="all")
    from_registry = StrategyRegistry.get(REGISTRY_PREFIX + name)
    assert type(from_yaml) is type(from_registry) is PRESETS[name].strategy
    observe = OBSERVED.get(type(from_yaml), lambda s: None)
    assert observe(from_yaml) == observe(from_registry)
    # A strategy travels by pickle: to a dry run's process with CUDA faked, and in Lightning's spawn launchers.
    assert observe(pickle.loads(pickle.dumps(from_yaml))) == observe(from_registry)
    if isinstance(from_yaml, FSDPStrategy):  # the config check before launch reads the sizes the strategy holds
        assert ParallelSizes.from_config(cfg.strategy) == from_yaml.parallel_sizes


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_trainer_accepts_registered_name_on_cpu(name):
    trainer = L.Trainer(strategy=REGISTRY_PREFIX + name, accelerator="cpu", devices=2, logger=False)
    assert type(trainer.strategy) is PRESETS[name].strategy
    assert trainer.strategy.root_device.type == "cpu"
    assert trainer.strategy._get_process_group_backend() == "gloo"


def test_lightning_names_are_left_alone():
    # Our presets are prefixed: Lightning's own `fsdp` still means Lightning's (GPU-only) FSDP strategy.
    assert StrategyRegistry["fsdp"]["strategy"].__module__.startswith("lightning.")
    assert type(StrategyRegistry.get("ld_fsdp")) is FSDPStrategy  # registered lazily: the class loads when built


def test_deepspeed_offload_presets_build_the_config_they_name():
    zero = StrategyRegistry.get("ld_deepspeed_stage_3_offload").config["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    assert "offload_param" not in StrategyRegistry.get("ld_deepspeed_stage_2_offload").config["zero_optimization"]


@pytest.mark.parametrize("first_import", [
    "import lightning_dist",  # before Lightning: registered when Lightning is imported
    "from lightning_dist.strategies import FSDPStrategy",  # our strategy module imports Lightning first
    "import lightning_dist.strategies.deepspeed",
    "import lightning_dist.strategies.deepspeed.config.resolve",  # Lightning first imported halfway through our package
    "import lightning; import lightning_dist",  # after Lightning: registered at once
])
def test_every_import_order_registers_every_preset(first_import):
    # A fresh interpreter: in this one, Lightning and the package are imported already.
    check = (f"{first_import}\nimport lightning.pytorch as pl\n"
             "print(sorted(n for n in pl.strategies.StrategyRegistry if n.startswith('ld_')))\n"
             "print(type(pl.Trainer(strategy='ld_fsdp_cpu_offload', accelerator='cpu', devices=2, logger=False).strategy))")
    process = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert process.returncode == 0, process.stderr[-2000:]
    assert process.stdout.splitlines()[-2:] == [str(sorted(REGISTRY_PREFIX + name for name in PRESET_NAMES)),
                                                 "<class 'lightning_dist.strategies.torch.fsdp.FSDPStrategy'>"]
