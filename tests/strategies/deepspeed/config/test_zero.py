"""ZeRO's settings read once (`ZeroSection`), and each rule about them with one message, whether the settings came
as the strategy's options or as a config file's section (lightning_dist/strategies/deepspeed/config/zero.py)."""

from __future__ import annotations

import pytest

from lightning_dist.strategies.deepspeed.config.zero import Offload, ZeroSection, option_problems

NVME_FILE = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"},
                                   "offload_param": {"device": "none"}}}


def test_a_section_is_read_once_into_types():
    zero = ZeroSection.of(NVME_FILE)
    assert zero == ZeroSection(3, Offload("nvme", "/nvme"), Offload(None))
    assert (zero.partitions_parameters, zero.offloads_optimizer, zero.offloads_to_host) == (True, True, True)
    assert zero.nvme_paths() == {"zero_optimization.offload_optimizer.nvme_path": "/nvme"}
    assert ZeroSection.of({}) == ZeroSection(0, Offload(), Offload())  # DeepSpeed's defaults: stage 0, nothing offloaded
    assert not ZeroSection.of({}).offloads_to_host


@pytest.mark.parametrize(("options", "file_section", "message"), [
    ({"stage": 2, "offload_parameters": "cpu"}, {"stage": 2, "offload_param": {"device": "cpu"}},
     "{offload}: parameter offload needs ZeRO stage 3, got {stage}=2; choose {stage}=3 or {offload}=null"),
    ({"stage": 5}, {"stage": 5}, "{stage}: 5 is not a ZeRO stage; choose one of 1, 2, 3"),
    ({"offload_optimizer": "gpu"}, {"offload_optimizer": {"device": "gpu"}},
     "{optimizer}: 'gpu' is not an offload device; choose one of null, cpu, nvme"),
])
def test_contradictory_settings_get_the_same_message_from_options_and_from_a_file(options, file_section, message):
    """The rule is written once; only the keys differ, each named as the user wrote it."""
    from_options = option_problems(options.get("stage"), options.get("offload_optimizer"),
                                   options.get("offload_parameters"), None, with_config=False)
    from_file = ZeroSection.of({"zero_optimization": file_section}).problems()
    strategy_keys = {"stage": "strategy.stage", "offload": "strategy.offload_parameters",
                     "optimizer": "strategy.offload_optimizer"}
    file_keys = {"stage": "zero_optimization.stage", "offload": "zero_optimization.offload_param",
                 "optimizer": "zero_optimization.offload_optimizer.device"}
    assert from_options == [message.format(**strategy_keys)]
    assert from_file == [message.format(**file_keys)]


def test_nvme_without_a_directory_is_one_problem_naming_where_to_set_it():
    assert option_problems(3, "nvme", None, None, with_config=False) == [
        "strategy.nvme_path: NVMe offload needs a directory to offload to; set strategy.nvme_path"]
    # With a file, the file's own path may stand in: the two are compared when the run starts.
    assert option_problems(3, "nvme", None, None, with_config=True) == []
    section = ZeroSection.of({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    assert section.problems() == [
        "zero_optimization.offload_param.nvme_path: NVMe offload needs a directory to offload to;"
        " set zero_optimization.offload_param.nvme_path or strategy.nvme_path"]
