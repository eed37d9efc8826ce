"""Checkpoints that leave the frozen weights out (`exclude_frozen_parameters=True`, DeepSpeed's option in Lightning,
ours under every engine).

A LoRA fine-tune's base never changes: every save of it repeats the pretrained model (a 7B base: 14 GB a save, the
adapters 50 MB). Left out, it must come back from where the run got it: the model as the resumed run builds it. So a
save records each frozen weight's shape and fingerprint (its sum and sum of squares, in float64), and a resume
compares them with the weights of the model as built, then loads the rest around them (no rank reads the base
again, nor sends it). A model built otherwise (a random base, another pretrained folder, a base trained before it was
frozen) is refused in one line, not resumed on. Lightning itself wrote such checkpoints and could not load them
(`Missing key(s) in state_dict`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from lightning_dist._compat.lightning import StrategyMixin
from lightning_dist.checkpoints.formats import CURRENT_MODEL_STATE, CheckpointError
from lightning_dist.checkpoints.gather import plain_name

LEFT_OUT = "frozen_weights_left_out"  # the checkpoint's key: the weights it does not hold, by name
_CHUNK = 1 << 24  # elements summed at a time: float64 copies of 128 MiB, not of a whole embedding
_RELATIVE = 1e-9  # float64 sums of the same values in another order (another device, another partitioning)


class LeavesFrozenWeightsOut(StrategyMixin):
    """Strategy mixin (before the saves are staged or written, in the bases): with `exclude_frozen_parameters`, a
    save holds no frozen weight and records each one's fingerprint. DeepSpeed's engine leaves them out of its files
    itself (Lightning passes it the option); the others' state dicts are filtered here."""

    exclude_frozen_parameters: bool = False

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(self.without_frozen_weights(checkpoint), filepath, storage_options)

    def without_frozen_weights(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """`checkpoint` as it is saved: without the frozen weights, and with their fingerprints (a collective under
        ZeRO-3 and FSDP: every rank saves)."""
        module = self.lightning_module
        if not self.exclude_frozen_parameters or module is None or not (left_out := frozen_fingerprints(module)):
            return checkpoint
        checkpoint = {**checkpoint, LEFT_OUT: left_out}
        for key in ("state_dict", CURRENT_MODEL_STATE):  # the second: the model's own, where the first is an average
            if isinstance(weights := checkpoint.get(key), dict):
                checkpoint[key] = {name: value for name, value in weights.items() if plain_name(name) not in left_out}
        return checkpoint


@contextmanager
def frozen_weights_out_of_state_dicts(module: nn.Module) -> Iterator[None]:
    """Meanwhile `module.state_dict()` holds no name of a frozen weight. DeepSpeed's engine, told to leave them out,
    deletes each by its first name only: a tied one (Qwen2's and Llama 3.2's head is their embedding) stayed in its
    files whole under its second name (ZeRO-1/2), or as an empty placeholder that another engine's resume found
    lacking (ZeRO-3)."""
    frozen = [name for name, parameter in module.named_parameters(remove_duplicate=False)
              if not parameter.requires_grad]

    def leave_out(_: nn.Module, state_dict: dict[str, Any], prefix: str, __: Any) -> None:
        for name in frozen:
            state_dict.pop(prefix + name, None)

    handle = module.register_state_dict_post_hook(leave_out)
    try:
        yield
    finally:
        handle.remove()


def frozen_fingerprints(module: nn.Module) -> dict[str, dict[str, list]]:
    """{name: {"shape": ..., "fingerprint": [sum, sum of squares]}} of the module's frozen parameters, each whole (a
    collective under ZeRO-3 and FSDP: call it on every rank)."""
    return _fingerprints(module, lambda name, parameter: not parameter.requires_grad)


def _fingerprints(module: nn.Module, keep: Callable[[str, nn.Parameter], bool]) -> dict[str, dict[str, list]]:
    fingerprints: dict[str, dict[str, list]] = {}
    for names, value in _whole_parameters(module, keep):
        entry: dict[str, list] = {"shape": list(value.shape), "fingerprint": fingerprint(value)}
        fingerprints.update(dict.fromkeys(names, entry))
    return fingerprints


def fingerprint(tensor: torch.Tensor) -> list[float]:
    flat = tensor.detach().reshape(-1)
    total = squares = torch.zeros((), dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), _CHUNK):
        chunk = flat[start:start + _CHUNK].double()
        total, squares = total + chunk.sum(), squares + torch.dot(chunk, chunk)  # dot: half square().sum()'s time
    return [total.item(), squares.item()]


def check_left_out(module: nn.Module, left_out: Mapping[str, Mapping[str, list]]) -> None:
    """CheckpointError naming them, unless the model as built holds the frozen weights a checkpoint left out, as
    they were saved (a collective under ZeRO-3 and FSDP: call it on every rank)."""
    # By name, frozen or not now: a callback may freeze or unfreeze them later (Lightning's BackboneFinetuning).
    built = _fingerprints(module, lambda name, parameter: name in left_out)
    absent = sorted(set(left_out) - set(built))
    differ = sorted(name for name in set(left_out) & set(built) if not _same(left_out[name], built[name]))
    if absent:
        raise CheckpointError(
            f"ckpt_path: the checkpoint left its frozen weights out (exclude_frozen_parameters=True) and the model as"
            f" built has no {', '.join(absent[:3])} (of {len(absent)}): build it as the run that saved it did, or"
            " resume from a checkpoint that holds them"
        )
    if differ:
        raise CheckpointError(
            f"ckpt_path: the checkpoint left its frozen weights out (exclude_frozen_parameters=True) and the model as"
            f" built holds others: {', '.join(differ[:3])} (of {len(differ)}) differ from the ones it was saved"
            " with; load the same pretrained weights (in __init__ or configure_model) before resuming"
        )


def may_lack(checkpoint: Mapping[str, Any]) -> set[str]:
    """The weights a (checked) checkpoint does not hold and a load leaves as the model has them."""
    return set(checkpoint.get(LEFT_OUT) or ())


def load_around_left_out(module: nn.Module, checkpoint: Mapping[str, Any], strict: bool) -> None:
    """`checkpoint["state_dict"]` into a whole (unsharded) module, its left-out weights kept as the model has them;
    under `strict`, a CheckpointError for any other weight it lacks or does not know."""
    state_dict = checkpoint["state_dict"]
    expected = set(module.state_dict())
    missing, unexpected = sorted(expected - set(state_dict) - may_lack(checkpoint)), sorted(set(state_dict) - expected)
    if strict and (missing or unexpected):
        raise CheckpointError(f"ckpt_path: the checkpoint has no weights for {', '.join(missing[:3]) or '-'} and"
                              f" weights this model has not: {', '.join(unexpected[:3]) or '-'}")
    module.load_state_dict(state_dict, strict=False)


def _same(saved: Mapping[str, list], built: Mapping[str, list]) -> bool:
    if list(saved["shape"]) != list(built["shape"]):
        return False
    pairs = zip(saved["fingerprint"], built["fingerprint"])
    return all(abs(a - b) <= _RELATIVE * max(abs(a), abs(b), 1e-30) for a, b in pairs)


def _whole_parameters(module: nn.Module, keep: Callable[[str, nn.Parameter], bool],
                      ) -> Iterator[tuple[list[str], torch.Tensor]]:
    """(names, whole value) of each parameter `keep` takes, one at a time: a ZeRO-3 partition gathered, an FSDP2
    shard's full tensor; only one of them is whole at a time. A tied weight has every name a state dict gives it
    (Qwen2's and Llama 3.2's head is their embedding: `named_parameters()` names it once, `state_dict()` twice, and a
    save that left out only the first name held the embedding whole under `lm_head.weight`)."""
    from torch.distributed.tensor import DTensor

    names: dict[nn.Parameter, list[str]] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        if keep(plain_name(name), parameter):
            names.setdefault(parameter, []).append(plain_name(name))
    for parameter, its_names in names.items():
        with _gathered(parameter):
            yield its_names, parameter.full_tensor() if isinstance(parameter, DTensor) else parameter


def _gathered(parameter: nn.Parameter) -> Any:
    if not hasattr(parameter, "ds_tensor"):
        return nullcontext()
    from lightning_dist._compat.deepspeed import zero3_gathered

    return zero3_gathered([parameter])
