"""lightning-dist: pick DDP, FSDP2 or DeepSpeed ZeRO by name; the same LightningModule trains on CPU or CUDA.

`import lightning_dist` registers the `ld_*` strategy names with Lightning (now, or when Lightning is imported),
silences the pinned libraries' warnings about their own code (lifecycle/library_warnings.py), and imports nothing heavy
itself: the strategy classes load on first use.
"""

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from lightning_dist._compat.versions import warn_if_unsupported
from lightning_dist.lifecycle.library_warnings import quiet_library_warnings
from lightning_dist.registration import register_presets_with_lightning

warn_if_unsupported()
quiet_library_warnings()
register_presets_with_lightning()

try:  # one place says the version: pyproject.toml, read from the installed metadata
    __version__ = version("lightning-dist")
except PackageNotFoundError:  # the source tree on sys.path, never installed
    __version__ = "0+unknown"

__all__ = [
    "DDPStrategy", "DeepSpeedStrategy", "FSDPStrategy", "from_pretrained", "load_from_checkpoint", "mean_when_logged",
    "save_adapters", "save_pretrained",
]


def __getattr__(name: str) -> Any:
    if name == "load_from_checkpoint":
        from lightning_dist.checkpoints.consolidate import load_from_checkpoint

        return load_from_checkpoint
    if name == "save_adapters":
        from lightning_dist.checkpoints.adapters import save_adapters

        return save_adapters
    if name == "save_pretrained":
        from lightning_dist.checkpoints.save_pretrained import save_pretrained

        return save_pretrained
    if name == "mean_when_logged":
        from lightning_dist.parallel.logged_means import mean_when_logged

        return mean_when_logged
    if name == "from_pretrained":
        from lightning_dist.models.pretrained import from_pretrained

        return from_pretrained
    if name in __all__:
        from lightning_dist import strategies

        return getattr(strategies, name)
    raise AttributeError(f"module 'lightning_dist' has no attribute {name!r}")
