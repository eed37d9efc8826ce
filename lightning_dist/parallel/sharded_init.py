"""Building a model without its weights, then initialising only what each rank keeps.

Construction under `parameters_on_meta()` puts every parameter on the meta device: it holds a shape and no memory.
Buffers stay real: they are small, and often computed (masks, frequencies) rather than drawn at random. A sharding
strategy then shards the meta model and calls `initialize_parameters` with what to keep of each full tensor.

`initialize_parameters` visits the modules in order and draws one module's parameters at a time, full size, on the
CPU, with a generator seeded by the module's name; the rank keeps its part and drops the rest. So no rank ever
holds more than one module's full weights, and the values do not depend on sharding, world size or device: a
model that initialises itself eagerly through the same function (our GPT does) starts from the same weights under
ddp as under fsdp or ZeRO-3, for the same seed.

A module is initialised by its own `reset_parameters()` (torch's convention; `_reset_parameters()` for its
attention), then by `_init_weights(module)` of the nearest enclosing module that defines one (Hugging Face's, and
our GPT's). The seed is the `init_seed` attribute of the nearest enclosing module that has one, else the one the
caller passes.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_dist._compat.lightning import StrategyMixin
from lightning_dist._compat.torch import (
    WRAPPER_MODULE_NAMES,
    own_parameters,
    parameter_initialiser,
    parameter_registration,
)

# What to keep of an initialised full tensor (on the CPU, in the parameter's dtype): a shard, a partition, all.
Keep = Callable[[nn.Parameter, torch.Tensor], None]

# Module names that wrappers (activation checkpointing) insert between a model and its layers; a layer's seed must
# not depend on them.
_WRAPPER_NAMES = WRAPPER_MODULE_NAMES

_REGISTER_PARAMETER = nn.Module.register_parameter  # torch's own, whatever a context below has patched in since


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Parameters registered inside this context live on the meta device (no memory); buffers stay where they are."""
    register_parameter = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        # A DTensor is a split of a parameter that exists already (a configure_model's parallelize_module registers
        # each layer's weights again as their shards): its values are kept.
        if param is not None and not param.is_meta and not isinstance(param, DTensor):
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register_parameter(module, name, param)

    with parameter_registration(register_on_meta):
        yield


@contextmanager
def parameters_in_memory() -> Iterator[None]:
    """Inside `parameters_on_meta`, parameters registered here hold memory again: for weights loaded from disk
    (`from_pretrained`), which a sharding strategy would otherwise initialise afresh. Each rank then holds them
    whole, on the CPU, until the strategy shards them."""
    with parameter_registration(_REGISTER_PARAMETER):
        yield


def has_meta_parameters(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


class ForgetsUnbuiltModel(StrategyMixin):
    """Strategy mixin: a run that ends before `setup` built the model (its parameters still on the meta device)
    has nothing to move back to the CPU at teardown, which would fail on meta tensors."""

    def teardown(self) -> None:
        if self.lightning_module is not None and has_meta_parameters(self.lightning_module):
            self._lightning_module = None
        super().teardown()


def draw_init_seed() -> int:
    """A seed for `initialize_parameters` from the global generator: the same after the same `seed_everything`,
    different for each model built in a row."""
    return int(torch.randint(0, 2**62, (), device="cpu"))


def initialize_parameters(
    model: nn.Module, keep: Keep | None = None, seed: int = 0, params: Iterable[nn.Parameter] | None = None
) -> int:
    """Initialise `params` module by module; returns how many were initialised.

    Each full value goes to `keep`; without one it is copied into the parameter (eager construction), and `params`
    defaults to those that hold memory (a model built on the meta device, e.g. to plan its memory, is left alone).
    A parameter shared by two modules is initialised by the first. A parameter that no initialiser writes is an
    error, not uninitialised memory.
    """
    if params is None:
        params = [p for p in model.parameters() if keep is not None or not p.is_meta]
    pending = {id(p) for p in params}
    done: set[int] = set()
    for name, module in model.named_modules():
        params_here = {n: p for n, p in own_parameters(module).items() if p is not None}
        todo = {n: p for n, p in params_here.items() if id(p) in pending and id(p) not in done}
        if not todo:
            continue
        owner_seed, relative_name, init_weights = _initialiser_of(model, name, seed)
        reset = parameter_initialiser(module)
        # NaN until an initialiser writes it: what none writes is found below, not trained as uninitialised memory.
        full = {n: _unwritten(p) for n, p in params_here.items()}
        with _swapped_parameters(module, full), torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(_module_seed(owner_seed, relative_name))
            if callable(reset):
                reset()
            if init_weights is not None:
                init_weights(module)
        untouched = [n for n in todo if full[n].is_floating_point() and full[n].isnan().any()]
        if untouched:
            raise ValueError(
                f"model: {name or type(model).__name__} ({type(module).__name__}) has parameters "
                f"({', '.join(untouched)})"
                " that neither its reset_parameters() nor an enclosing _init_weights(module) initialises; add one,"
                " or build the model eagerly (outside init_module/configure_model)"
            )
        with torch.no_grad():  # a DTensor's to_local() is a copy, not a view, where autograd records it
            for n, param in todo.items():
                (keep or _copy_into)(param, full[n].to(param.dtype))
                done.add(id(param))
    return len(done)


def give_memory(param: nn.Parameter, value: torch.Tensor) -> None:
    """Make a meta parameter hold `value`, keeping the parameter object (optimizers and tied modules refer to it)."""
    if param.is_meta:  # `param.data = value` refuses a change from meta to a real device
        torch.utils.swap_tensors(param, nn.Parameter(value, requires_grad=param.requires_grad))
    else:
        param.data = value


def _copy_into(param: nn.Parameter, value: torch.Tensor) -> None:
    param.copy_(value)


def _unwritten(param: nn.Parameter) -> torch.Tensor:
    # Drawn in float32 and then cast, as eager construction does before a precision plugin converts the model.
    if param.is_floating_point():
        return torch.full(param.shape, math.nan, dtype=torch.float32, device="cpu")
    return torch.zeros(param.shape, dtype=param.dtype, device="cpu")


def _initialiser_of(model: nn.Module, name: str, default_seed: int) -> tuple[int, str, Callable | None]:
    """(seed, the module's name relative to the seed's owner, the nearest `_init_weights`) for module `name`."""
    parts = name.split(".") if name else []
    seed, relative, init_weights = default_seed, parts, None
    owner = model
    for depth in range(len(parts) + 1):
        if depth:
            owner = getattr(owner, parts[depth - 1])
        if isinstance(getattr(owner, "init_seed", None), int):
            seed, relative = int(owner.init_seed), parts[depth:]  # type: ignore[arg-type]
        if callable(getattr(owner, "_init_weights", None)):
            init_weights = getattr(owner, "_init_weights")
    return seed, ".".join(p for p in relative if p not in _WRAPPER_NAMES), init_weights


def _module_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


@contextmanager
def _swapped_parameters(module: nn.Module, values: dict[str, torch.Tensor]) -> Iterator[None]:
    """The module's own parameters replaced by plain full-size ones for its initialisers to write into."""
    table = own_parameters(module)
    original = dict(table)
    for n, value in values.items():
        table[n] = nn.Parameter(value, requires_grad=getattr(original[n], "requires_grad", True))
    try:
        yield
    finally:
        table.update(original)
