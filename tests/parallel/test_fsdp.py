"""FSDP2 mechanics in one process: a one-rank gloo group is enough to exercise wrapping and recomputation."""

from types import SimpleNamespace

import hydra
import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, OffloadPolicy

from lightning_dist.models.gpt import TransformerBlock
from lightning_dist.optim import require_shardable_optimizer
from lightning_dist.optim.configured import WHOLE_PARAMETER_OPTIMIZERS
from lightning_dist.parallel import apply_activation_checkpointing, infer_block_classes, sharding_layout
from lightning_dist.strategies.torch.fully_shard import apply_fully_shard, offload_policy
from tests.conftest import CONF_DIR, one_rank_world
from tests.parallel.test_activation_checkpoint import tiny_gpt


@pytest.fixture(scope="module")
def mesh():
    with one_rank_world():
        yield init_device_mesh("cpu", (1,))


@pytest.mark.parametrize(
    ("name", "layout"),
    [("FULL_SHARD", (True, False)), ("shard_grad_op", (False, False)), ("HYBRID_SHARD", (True, True))],
)
def test_sharding_strategy_names(name, layout):
    assert sharding_layout(name) == layout


def test_unknown_sharding_strategy_lists_choices():
    with pytest.raises(ValueError) as error:
        sharding_layout("NO_SHARD")
    assert str(error.value) == (
        "strategy.sharding_strategy: 'NO_SHARD' is not supported; choose one of FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD"
    )


def test_offload_policy_pins_memory_only_for_cuda():
    assert type(offload_policy(False, torch.device("cpu"))) is OffloadPolicy
    assert offload_policy(True, torch.device("cpu")).pin_memory is False
    assert offload_policy(True, torch.device("cuda", 1)).pin_memory is True


def shard(model, mesh, **overrides):
    kwargs = dict(mesh=mesh, block_classes=(TransformerBlock,), reshard_after_forward=True, offload=OffloadPolicy())
    return apply_fully_shard(model, **{**kwargs, **overrides})


def test_one_unit_per_block_plus_root_and_idempotent(mesh):
    model = tiny_gpt(n_layer=3)
    assert shard(model, mesh) == 4
    assert shard(model, mesh) == 4
    assert all(isinstance(block, FSDPModule) for block in model.blocks)


def test_checkpointed_blocks_are_sharded_through_their_wrapper_and_recomputed(mesh, block_forwards):
    tokens = torch.randint(0, 32, (2, 8))
    reference, model = tiny_gpt(), tiny_gpt()
    apply_activation_checkpointing(model, (TransformerBlock,))
    assert shard(model, mesh) == 4
    assert all(isinstance(block, CheckpointWrapper) and isinstance(block, FSDPModule) for block in model.blocks)

    model(tokens).sum().backward()
    assert block_forwards[0] == 6  # 3 blocks forward + 3 recomputed in backward
    reference(tokens).sum().backward()

    grads = {name.replace("._checkpoint_wrapped_module", ""): p.grad.full_tensor() for name, p in model.named_parameters()}
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, msg=name)


def test_root_only_without_block_class(mesh):
    model = tiny_gpt()
    assert shard(model, mesh, block_classes=()) == 1
    assert isinstance(model, FSDPModule) and not isinstance(model.blocks[0], FSDPModule)


def test_set_up_again_after_fit_infers_the_same_blocks(mesh):
    # Lightning sets the strategy up again for trainer.test() after fit(): each block is by then a checkpoint
    # wrapper and an FSDP module, and must neither be taken for a new block class nor be wrapped twice.
    model = tiny_gpt(n_layer=3)
    for _ in range(2):
        classes = infer_block_classes(model)
        assert classes == (TransformerBlock,)
        assert apply_activation_checkpointing(model, classes) == 3
        assert shard(model, mesh, block_classes=classes) == 4


class _StepModule(torch.nn.Module):
    """A Lightning-shaped root: its step method calls `forward`, as `training_step` usually does."""

    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_gpt(n_layer=2)

    def forward(self, tokens):
        return self.model(tokens)

    def training_step(self, tokens):
        return self(tokens).float().pow(2).mean()


def test_a_step_method_that_calls_forward_gathers_the_root_once_a_step(mesh, monkeypatch):
    """FSDP2 ends its pass at the nested `forward`, and the step method's end then freed the root's parameters
    (kept after forward), so backward gathered them again: two gathers of the root per step instead of one."""
    module = _StepModule()
    apply_fully_shard(module, mesh=mesh, block_classes=(TransformerBlock,), reshard_after_forward=True,
                      offload=OffloadPolicy(), forward_methods=["training_step"])
    (root,) = module._get_fsdp_state()._fsdp_param_groups
    gathers = []
    to_unsharded = root._to_unsharded
    monkeypatch.setattr(root, "_to_unsharded", lambda: gathers.append(1) or to_unsharded())
    tokens = torch.randint(0, 32, (2, 8))
    losses = []
    for _ in range(3):
        loss = module.training_step(tokens)
        loss.backward()
        losses.append(loss.item())
        assert all(p.grad is not None for p in module.parameters())  # the root's gradients still reach its shards
    assert len(gathers) == 3
    assert losses[0] == losses[1] == losses[2]  # no optimizer: the same weights, gathered right each time


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF_DIR / "optimizer").glob("*.yaml")))
def test_every_optimizer_option_steps_sharded_parameters_or_is_refused(mesh, option):
    # FSDP2's parameters are DTensors: a fused kernel without a sharding rule for them fails at the first step.
    factory = hydra.utils.instantiate(OmegaConf.load(CONF_DIR / "optimizer" / f"{option}.yaml"))
    model = tiny_gpt(n_layer=1)
    shard(model, mesh)
    before = [p.full_tensor().clone() for p in model.parameters()]
    optimizer = factory(model.parameters())
    model(torch.zeros(2, 8, dtype=torch.long)).float().pow(2).mean().backward()
    if issubclass(factory.func, WHOLE_PARAMETER_OPTIMIZERS):  # refused before any rank starts, and rightly
        with pytest.raises(ValueError, match="^model.optimizer: .* needs each parameter whole and fsdp shards them"):
            require_shardable_optimizer(SimpleNamespace(optimizer_factory=factory), "fsdp")
        with pytest.raises(RuntimeError):
            optimizer.step()
        return
    optimizer.step()
    assert any(not torch.equal(p.full_tensor(), b) for p, b in zip(model.parameters(), before)), option
