"""The fence around library internals. Every private name of torch, Lightning, DeepSpeed, Hydra or CPython that the
package needs, and every patch it applies to them, goes through a named function here (one module per library), with the
public API that is missing and the versions it was checked on. An upgrade that breaks one breaks here, in one place:
`tests/test_compat_fence.py` checks that each fenced symbol still exists with the parameters we rely on, and that
nothing outside this package reaches past the fence.

The submodules are imported where they are used, not here: the CLI reads Hydra's grammar before torch is loaded.
"""

from __future__ import annotations

from lightning_dist._compat.fenced import Fenced

__all__ = ["Fenced", "fenced"]


def fenced() -> list[Fenced]:
    """Every symbol behind the fence, from each library's module."""
    from lightning_dist._compat import (
        bitsandbytes,
        deepspeed,
        fake_tensors,
        hydra,
        lightning,
        peft,
        python,
        torch,
        transformers,
    )

    return [*torch.FENCED, *fake_tensors.FENCED, *lightning.FENCED, *deepspeed.FENCED, *hydra.FENCED, *python.FENCED,
            *peft.FENCED, *transformers.FENCED, *bitsandbytes.FENCED]
