import pytest

from lightning_dist.strategies import DeepSpeedStrategy, FSDPStrategy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage": 4}, "strategy.stage: 4 is not a ZeRO stage; choose one of 1, 2, 3"),
        ({"stage": 2, "offload_parameters": "cpu"},
         "strategy.offload_parameters: parameter offload needs ZeRO stage 3, got strategy.stage=2;"
         " choose strategy.stage=3 or strategy.offload_parameters=null"),
        ({"offload_optimizer": "gpu"}, "strategy.offload_optimizer: 'gpu' is not an offload device; choose one of null, cpu, nvme"),
        ({"stage": 3, "offload_parameters": "nvme"},
         "strategy.nvme_path: NVMe offload needs a directory to offload to; set strategy.nvme_path"),
    ],
)
def test_deepspeed_rejects_impossible_combinations_in_one_line(kwargs, message):
    with pytest.raises(ValueError) as error:
        DeepSpeedStrategy(**kwargs)
    assert str(error.value) == message


def test_fsdp_rejects_unknown_sharding_and_block_class():
    with pytest.raises(ValueError, match="strategy.sharding_strategy: 'FULL' is not supported"):
        FSDPStrategy(sharding_strategy="FULL")
    with pytest.raises(ValueError, match="strategy.block_class: 'torch.nn.Blok' is not an nn.Module class"):
        FSDPStrategy(block_class="torch.nn.Blok")
