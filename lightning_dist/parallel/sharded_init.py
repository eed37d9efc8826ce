"""Building a model without its weights, then initialising only what each rank keeps.

Construction under `parameters_on_meta()` puts every parameter a module's constructor makes on the meta device: it
holds a shape and no memory. Weights that exist already (loaded, or PEFT's adapters) keep their values. Buffers stay
real: they are small, and often computed (masks, frequencies) rather than drawn at random. A sharding strategy then
shards the meta model and calls `initialize_parameters` with what to keep of each full tensor, for the parameters
that have no values only.

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
import weakref
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_dist._compat.lightning import StrategyMixin
from lightning_dist._compat.peft import TUNED_LAYER, adapter_cast_dtype, adapter_names, is_tuner_layer
from lightning_dist._compat.python import calling_frames, constructing, in_package
from lightning_dist._compat.torch import (
    WRAPPER_MODULE_NAMES,
    own_parameters,
    parameter_initialiser,
    parameter_registration,
)
from lightning_dist.parallel.pretrained_weights import BoundWeights, Region

# What to keep of an initialised tensor (on the CPU, in the parameter's dtype): a shard, a partition, all. It is given
# the region of the full tensor that `RegionKept` names for the parameter, or the whole tensor.
Keep = Callable[[nn.Parameter, torch.Tensor], None]
RegionKept = Callable[[nn.Parameter], Region | None]

# Module names that wrappers (activation checkpointing) insert between a model and its layers; a layer's seed must
# not depend on them.
_WRAPPER_NAMES = WRAPPER_MODULE_NAMES


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Parameters that a module's own constructor registers live on the meta device (a shape, no memory) until a
    sharding strategy initialises its shards; buffers stay where they are. Weights that exist are kept:

    - a parameter given to a module after it was built keeps its values: what `from_pretrained` loads (it builds the
      model empty, then sets each weight), or a user's `module.weight = nn.Parameter(...)` outside `__init__`;
    - `load_state_dict` into a meta parameter takes the value (torch's would copy into nothing, with a warning);
    - PEFT's adapters start from PEFT's own initial values (LoRA's B = 0), or from those `PeftModel.from_pretrained`
      loads into them, wherever PEFT then moves them: drawn afresh they would no longer start the fine-tune from the
      pretrained model, or resume it.
    """
    register_parameter = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        # A DTensor is a split of a parameter that exists already (a configure_model's parallelize_module registers
        # each layer's weights again as their shards): its values are kept.
        if param is not None and not param.is_meta and not isinstance(param, DTensor):
            frames = list(calling_frames())
            if in_package("peft", frames):
                # An adapter, which PEFT initialises next and then moves to its base layer's device (meta, where
                # the base was built so): its values are taken from this parameter when its module is initialised.
                # `PeftModel.from_pretrained` then loads saved adapters into it: those values replace PEFT's.
                _ADAPTERS.setdefault(module, {})[name] = param
                _load_into_meta(module)
            elif constructing(module, frames):
                param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
                _load_into_meta(module)
        register_parameter(module, name, param)

    global _building_on_meta
    _building_on_meta += 1
    try:
        with parameter_registration(register_on_meta):
            yield
    finally:
        _building_on_meta -= 1


_building_on_meta = 0  # how many `parameters_on_meta` contexts are open


def building_on_meta() -> bool:
    """Whether a model built now is built without weights, for a strategy to initialise its shards."""
    return _building_on_meta > 0


# Modules with a meta parameter whose `load_state_dict` gives such parameters the loaded values.
_LOADS_INTO_META: weakref.WeakSet[nn.Module] = weakref.WeakSet()
# PEFT's adapter modules, with the values PEFT built (and initialised) in them, and those later loaded into them, by
# name.
_ADAPTERS: weakref.WeakKeyDictionary[nn.Module, dict[str, torch.Tensor]] = weakref.WeakKeyDictionary()
_LOADED_ADAPTERS: weakref.WeakKeyDictionary[nn.Module, dict[str, torch.Tensor]] = weakref.WeakKeyDictionary()


def _load_into_meta(module: nn.Module) -> None:
    if module not in _LOADS_INTO_META:
        module.register_load_state_dict_pre_hook(_take_loaded_values)
        _LOADS_INTO_META.add(module)


def _take_loaded_values(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """`load_state_dict` pre-hook: each of the module's meta parameters named in `state_dict` is given its value,
    in the parameter's dtype (as the copy it would have been), keeping the parameter object. A PEFT adapter's value
    is kept as its initial one instead, which its shards are initialised from (before, a resumed adapter started
    again from LoRA's B = 0 under every sharding preset, silently)."""
    adapters = _ADAPTERS.get(module, {})
    for name, param in own_parameters(module).items():
        value = state_dict.get(prefix + name)
        if param is not None and param.is_meta and isinstance(value, torch.Tensor) and not value.is_meta \
                and value.shape == param.shape:
            if name in adapters:
                _LOADED_ADAPTERS.setdefault(module, {})[name] = value.detach().to(param.dtype, copy=True)
            else:
                give_memory(param, value.detach().to(param.dtype, copy=True))


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
    model: nn.Module, keep: Keep | None = None, seed: int = 0, params: Iterable[nn.Parameter] | None = None,
    region: RegionKept | None = None,
) -> int:
    """Initialise `params` module by module; returns how many were initialised.

    Each value goes to `keep`: the full tensor, or where `region` names a part of it for a parameter, that part
    alone (pretrained weights are then read from their file by that region only). Without `keep` it is copied into
    the parameter (eager construction), and `params` defaults to those that hold memory (a model built on the meta
    device, e.g. to plan its memory, is left alone).
    A parameter shared by two modules is initialised by the first. Where an enclosing module carries pretrained
    weights (pretrained_weights.py), a parameter's value is read from them rather than drawn. A parameter that no
    initialiser writes is an error, not uninitialised memory; so is a PEFT adapter left on the meta device.
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
        owner = _initialiser_of(model, name, seed)
        regions = {n: region(p) if region is not None else None for n, p in todo.items()}
        values = {**owner.read(todo, regions), **_part(_adapter_values(module, todo, owner.adapter_of), regions)}
        if owner.adapter_of is not None and len(values) < len(todo):
            raise ValueError(f"model: {name} is an adapter of PEFT's {type(owner.adapter_of).__name__} on the meta"
                             " device, whose initial values (LoRA's B = 0) were never seen; apply PEFT inside"
                             " init_module or configure_model, or outside both")
        if owner.weights is not None and len(values) < len(todo):
            unread = ", ".join(f"{owner.weights_name}.{n}".lstrip(".") for n in todo if n not in values)
            raise ValueError(f"model: {name} ({type(module).__name__}) is part of a model built to start from"
                             f" {owner.weights.folder.folder}, which has no {unread}; its names changed after"
                             " from_pretrained (a wrapper we do not know), so its values would be drawn afresh")
        if len(values) < len(todo):
            # Drawn whole (a generator's values depend on the shape it fills), then each rank's part taken.
            values = {**_part(_drawn(model, name, module, params_here, owner), regions), **values}
        with torch.no_grad():  # a DTensor's to_local() is a copy, not a view, where autograd records it
            for n, param in todo.items():
                (keep or _copy_into)(param, values[n].to(param.dtype))
                done.add(id(param))
    return len(done)


def _part(values: dict[str, torch.Tensor], regions: dict[str, Region | None]) -> dict[str, torch.Tensor]:
    """Each full value's region (all of it where none is named)."""
    return {n: value if regions.get(n) is None else value[regions[n]] for n, value in values.items()}


def _adapter_values(module: nn.Module, params: dict[str, nn.Parameter], tuner: nn.Module | None
                    ) -> dict[str, torch.Tensor]:
    """The values PEFT gave those of `params` that it built (sharded initialisation is their second one), as an eager
    build holds them: PEFT moves a new adapter to its base layer's dtype, which rounds it where the base is 16-bit,
    a rounding the adapter built beside a base on the meta device was spared (LoRA on a bf16 base trained 8.5e-5 off
    ddp's loss at step 1 under fsdp and ZeRO-3). Values loaded into the adapter are taken as they are."""
    built, loaded = _ADAPTERS.get(module, {}), _LOADED_ADAPTERS.get(module, {})
    cast = adapter_cast_dtype(tuner) if tuner is not None else None
    values = {}
    for n, p in params.items():
        if n in loaded and loaded[n].shape == p.shape:
            values[n] = loaded[n].detach()
        elif n in built and built[n].shape == p.shape:
            values[n] = built[n].detach() if cast is None else built[n].detach().to(cast)
    return values


def _drawn(model: nn.Module, name: str, module: nn.Module, params: dict[str, nn.Parameter],
           owner: _Initialiser) -> dict[str, torch.Tensor]:
    """Full values for `module`'s own `params`, drawn by its initialisers from the seed of its name."""
    reset = parameter_initialiser(module)
    # NaN until an initialiser writes it: what none writes is found below, not trained as uninitialised memory.
    full = {n: _unwritten(p) for n, p in params.items()}
    with _swapped_parameters(module, full), torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(_module_seed(owner.seed, owner.relative_name))
        if callable(reset):
            reset()
        if owner.init_weights is not None:
            owner.init_weights(module)
    untouched = [n for n, value in full.items() if value.is_floating_point() and value.isnan().any()]
    if untouched:
        raise ValueError(
            f"model: {name or type(model).__name__} ({type(module).__name__}) has parameters "
            f"({', '.join(untouched)})"
            " that neither its reset_parameters() nor an enclosing _init_weights(module) initialises; add one,"
            " or build the model eagerly (outside init_module/configure_model)"
        )
    return full


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


@dataclass
class _Initialiser:
    """What initialises one module: the seed and the module's name relative to the seed's owner, the nearest
    `_init_weights`, the nearest pretrained weights and the module's name relative to their owner, and the PEFT
    tuner layer the module is an adapter of (if any)."""

    seed: int
    relative_name: str
    init_weights: Callable | None
    weights: BoundWeights | None
    weights_name: str
    adapter_of: nn.Module | None

    def read(self, params: dict[str, nn.Parameter], regions: dict[str, Region | None]) -> dict[str, torch.Tensor]:
        """The values (each its region) of those of `params` (the module's own, by name) that the pretrained
        weights hold."""
        if self.weights is None:
            return {}
        prefix = f"{self.weights_name}." if self.weights_name else ""
        found = {n: self.weights.read(prefix + n, p.dtype, regions[n]) for n, p in params.items()}
        return {n: value for n, value in found.items() if value is not None}


def _initialiser_of(model: nn.Module, name: str, default_seed: int) -> _Initialiser:
    parts = name.split(".") if name else []
    found = _Initialiser(default_seed, "", None, None, "", None)
    seed_depth = weights_depth = 0
    peft_wrappers: set[int] = set()  # where a PEFT tuner layer holds the layer it tunes: not in the folder's names
    owner = model
    for depth in range(len(parts) + 1):
        if depth:
            owner = getattr(owner, parts[depth - 1])
        if isinstance(getattr(owner, "init_seed", None), int):
            found.seed, seed_depth = int(owner.init_seed), depth  # type: ignore[arg-type]
        if callable(getattr(owner, "_init_weights", None)):
            found.init_weights = getattr(owner, "_init_weights")
        if isinstance(getattr(owner, "pretrained_weights", None), BoundWeights):
            found.weights, weights_depth = owner.pretrained_weights, depth  # type: ignore[assignment]
        if depth < len(parts) and is_tuner_layer(owner):
            if parts[depth] in adapter_names(owner):
                found.adapter_of = owner
            elif parts[depth] == TUNED_LAYER:
                peft_wrappers.add(depth)
    found.relative_name = _unwrapped(parts, seed_depth, peft_wrappers)
    found.weights_name = _unwrapped(parts, weights_depth, peft_wrappers)
    return found


def _unwrapped(parts: list[str], start: int, skipped: Iterable[int] = ()) -> str:
    """The name of `parts[start:]` without the wrappers torch inserts (and those at positions `skipped`)."""
    skipped = set(skipped)
    return ".".join(p for depth, p in enumerate(parts) if depth >= start and depth not in skipped
                    and p not in _WRAPPER_NAMES)


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
