"""What transformers is told of ZeRO-3 while the engine runs (`_compat/transformers.py::declare_zero3`), in one
process: its generate() keeps ranks in step only where `is_deepspeed_zero3_enabled()` says so
(tests/models/test_generate_in_steps.py runs it on 2 ranks). A config the user registered is respected: a ZeRO-3 one
is kept as it is, another is put back when the engine ends."""

from __future__ import annotations

import pytest


class UsersConfig:  # what a user's `HfDeepSpeedConfig` gives transformers
    def __init__(self, stage: int):
        self.config = {"zero_optimization": {"stage": stage}}
        self.stage = stage

    def is_zero3(self) -> bool:
        return self.stage == 3


@pytest.fixture
def deepspeed_integration():
    from transformers.integrations import deepspeed

    deepspeed.unset_hf_deepspeed_config()
    yield deepspeed
    deepspeed.unset_hf_deepspeed_config()


def test_declared_while_the_engine_runs_then_withdrawn(deepspeed_integration):
    from lightning_dist._compat.transformers import declare_zero3, withdraw_zero3

    config = {"zero_optimization": {"stage": 3}}
    declaration = declare_zero3(config)
    assert deepspeed_integration.is_deepspeed_zero3_enabled() and deepspeed_integration.deepspeed_config() is config
    withdraw_zero3(declaration)
    assert not deepspeed_integration.is_deepspeed_zero3_enabled() and deepspeed_integration.deepspeed_config() is None


def test_a_users_zero3_config_is_left_as_it_is(deepspeed_integration):
    from lightning_dist._compat.transformers import declare_zero3

    users = UsersConfig(stage=3)
    deepspeed_integration.set_hf_deepspeed_config(users)
    assert declare_zero3({"zero_optimization": {"stage": 3}}) is None
    assert deepspeed_integration.deepspeed_config() is users.config


def test_a_users_config_of_another_stage_is_replaced_then_put_back(deepspeed_integration):
    from lightning_dist._compat.transformers import declare_zero3, withdraw_zero3

    users = UsersConfig(stage=2)
    deepspeed_integration.set_hf_deepspeed_config(users)
    declaration = declare_zero3({"zero_optimization": {"stage": 3}})
    assert deepspeed_integration.is_deepspeed_zero3_enabled()
    withdraw_zero3(declaration)
    assert deepspeed_integration.deepspeed_config() is users.config
    assert not deepspeed_integration.is_deepspeed_zero3_enabled()


def test_one_line_where_transformers_does_not_read_it_back(deepspeed_integration, monkeypatch):
    from lightning_dist._compat.transformers import declare_zero3

    monkeypatch.setattr(deepspeed_integration, "set_hf_deepspeed_config", lambda registered: None)  # reads nothing
    with pytest.raises(RuntimeError, match="^transformers did not read back the ZeRO-3 config .* [(]a hang[)]$"):
        declare_zero3({"zero_optimization": {"stage": 3}})
