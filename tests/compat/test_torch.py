"""The functions lightning_dist/_compat/torch.py and fake_tensors.py put in front of torch's internals, each doing what
it says on the installed torch. The fence test checks that a fenced name still exists; a name that exists on every release but
changed its meaning (an attribute that became a list, a lock file that became an advisory lock) is caught only
here. CI runs this module on the oldest and the newest torch we support as well (`-m compat`)."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from lightning_dist._compat import fake_tensors as fakes
from lightning_dist._compat import torch as fence

pytestmark = pytest.mark.compat


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def test_fsdp_s_parameter_groups_are_found_and_a_step_method_reopens_forward():
    """torch 2.11 keeps one `_fsdp_param_group` per unit; 2.12 on, a list (the singular name raises for several)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    with fakes.fake_process_group(0, 2):
        model = TwoLayers()
        fully_shard(model.first)
        fully_shard(model)
        (first,) = fence.fsdp_param_groups(model.first)
        (root,) = fence.fsdp_param_groups(model)
        assert [p.sharded_param.to_local().shape for p in first.fsdp_params] == [(2, 4), (2,)]  # the shards of rank 0 of 2
        assert [p.sharded_param.to_local().shape for p in root.fsdp_params] == [(1, 4), (1,)]

        fence.reopen_fsdp_forward(model)
        assert root._training_state == TrainingState.FORWARD
        assert model._get_fsdp_state()._training_state == TrainingState.FORWARD


def test_an_fsdp_unit_without_parameters_has_no_groups():
    from torch.distributed.fsdp import fully_shard

    with fakes.fake_process_group(0, 2):
        holder = nn.Module()
        holder.register_buffer("steps", torch.zeros(()))
        fully_shard(holder)
        assert fence.fsdp_param_groups(holder) == []


def test_the_build_lock_is_the_one_torch_s_extension_builder_takes():
    """Through torch 2.13 a lock file whose existence blocks (FileBaton), which a killed process leaves behind; from
    2.14 an advisory lock on the same file (FileLock), which ends with its holder and leaves a file that blocks
    nothing: only the first is ever cleared."""
    from pathlib import Path

    from torch.utils import cpp_extension

    source = inspect.getsource(cpp_extension._jit_compile)
    lock = fence.extension_build_lock(Path("/build/op"))
    if lock is None:
        assert "FileLock(os.path.join(build_directory, 'lock'))" in source and "FileBaton(" not in source
    else:
        assert lock == Path("/build/op/lock")
        assert "FileBaton(os.path.join(build_directory, 'lock'))" in source


def test_a_device_mismatch_under_fake_tensors_names_both_devices():
    """An op given host and meta tensors under fake tensors: each release words it otherwise (2.13 added an error
    class); an in-place op on a tensor of another device than the op's is worded alike in every release."""
    with fakes.fake_tensors() as mode:
        host = mode.from_tensor(torch.zeros(3))
        other = mode.from_tensor(torch.zeros(3, device="meta"))
        scalar_on_host = mode.from_tensor(torch.zeros(()))
        scalar_elsewhere = mode.from_tensor(torch.zeros((), device="meta"))
        with pytest.raises(RuntimeError) as given_two:
            torch.add(host, other)
        with pytest.raises(RuntimeError) as written_on_another:
            scalar_on_host.add_(scalar_elsewhere)
    assert set(fakes.device_mismatch(given_two.value)) == {torch.device("cpu"), torch.device("meta")}
    assert fakes.device_mismatch(written_on_another.value) == (torch.device("meta"), torch.device("cpu"))
    assert fakes.device_mismatch(RuntimeError("something else")) is None


def test_fake_tensors_do_what_tensors_do_where_the_loop_needs_it():
    """What lightning_dist/dry_run/fake_loop.py relies on, on every release: a parameter built on the meta device and given
    fake memory stays the same object; a fake tensor deep-copies; a boolean mask selects every element; reading a
    value gives 1.0, 0 or False. (`.data =` across devices needs two: tests/test_loop_on_cuda.py.)"""
    import copy

    from lightning_dist.parallel.sharded_init import give_memory, parameters_on_meta

    with parameters_on_meta():
        layer = nn.Linear(4, 2)
    weight = layer.weight
    with fakes.fake_devices() as mode:
        fakes.made_fake_in_place(layer, mode)  # meta parameters stay: a strategy initialises them
        assert layer.weight.is_meta
        give_memory(layer.weight, torch.ones(2, 4))
        assert layer.weight is weight and not layer.weight.is_meta and fakes._is_fake(layer.weight)

        buffer_owner = nn.Module()
        buffer_owner.register_buffer("steps", torch.zeros(3))
        fakes.made_fake_in_place(buffer_owner, mode)
        assert fakes._is_fake(buffer_owner.steps)

        assert copy.deepcopy(torch.zeros(2)).shape == (2,)
        assert torch.ones(5)[torch.ones(5) > 2].shape == (5,)
        assert (torch.ones(()).item(), torch.ones((), dtype=torch.long).item(), bool(torch.ones(()) > 0)) == (1.0, 0, False)


def test_the_wrapper_names_are_what_activation_checkpointing_inserts():
    block = TwoLayers()
    wrapper = fence.checkpoint_wrapper(block)
    assert fence.checkpointed_module(wrapper) is block and fence.checkpointed_module(block) is block
    assert [name for name, _ in wrapper.named_children()] == [fence.WRAPPER_MODULE_NAMES[0]]


def test_a_module_s_own_initialiser_includes_multihead_attention_s_private_one():
    attention, linear = nn.MultiheadAttention(4, 2), nn.Linear(4, 4)
    assert fence.parameter_initialiser(linear) == linear.reset_parameters
    with torch.no_grad():
        attention.in_proj_weight.fill_(7.0)
    fence.parameter_initialiser(attention)()
    assert not torch.all(attention.in_proj_weight == 7.0)


def test_the_attention_kernels_and_collective_namespaces_are_torch_s_ops():
    import torch.distributed  # registers the process groups' ops, and the functional collectives DTensor uses

    assert all(callable(getattr(torch.ops.aten, name)) for name in fence.ATTENTION_KERNEL_OPS)
    process_groups, functional = (getattr(torch.ops, namespace) for namespace in fence.COLLECTIVE_NAMESPACES)
    assert process_groups.barrier.default.namespace == "c10d"
    assert functional.all_gather_into_tensor.default.namespace == fence.COLLECTIVE_NAMESPACES[1]
