"""One-line errors for bad command-line overrides, found before Hydra runs the job (and so before any rank).

Hydra's own messages for these span several lines and do not list what would have been valid.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


class ConfigError(ValueError):
    """A configuration mistake, said in one line that names the key and the valid choices."""


def group_options(group: str, conf_dir: Path = CONF_DIR) -> list[str]:
    return sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))


def check_overrides(overrides: list[str], config_name: str = "train", conf_dir: Path = CONF_DIR) -> DictConfig | None:
    """Compose the config with `overrides` and return it, or raise ConfigError for the first bad override.

    Sweeps (`strategy=ddp,fsdp`) get their group choices checked; each swept job is composed by Hydra itself.
    """
    groups = {p.name for p in conf_dir.iterdir() if p.is_dir()}
    parsed = OverridesParser.create().parse_overrides(overrides)
    for override in parsed:
        key = override.key_or_group.split("@")[0]
        if key in groups and not override.is_delete():
            values = list(override.sweep_string_iterator()) if override.is_sweep_override() else [override.value()]
            _check_group_choice(key, values, conf_dir)
    if any(override.is_sweep_override() for override in parsed):
        return None

    group_overrides = [o.input_line for o in parsed if o.key_or_group.split("@")[0] in groups]
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        base = compose(config_name, overrides=group_overrides)
        for override in parsed:
            key = override.key_or_group
            if key.split("@")[0] in groups or key.startswith("hydra.") or override.is_add() or override.is_delete():
                continue
            _check_key_exists(base, key)
        try:
            return compose(config_name, overrides=overrides)
        except (HydraException, OmegaConfBaseException) as error:
            raise ConfigError(" ".join(str(error).split())) from None


def _check_group_choice(group: str, values: list, conf_dir: Path) -> None:
    choices = group_options(group, conf_dir)
    for choice in values:
        if choice is not None and str(choice) not in choices:
            raise ConfigError(f"{group}={choice}: no such option; choose one of: {', '.join(choices)}")


def _check_key_exists(cfg: DictConfig, key: str) -> None:
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    if isinstance(parent, DictConfig) and leaf in parent:
        return
    if not isinstance(parent, DictConfig):
        # Walk up to the first missing segment, so the message names it.
        return _check_key_exists(cfg, parent_key)
    valid = [str(k) for k in parent.keys()]
    close = difflib.get_close_matches(leaf, valid, n=1)
    hint = f"did you mean {parent_key + '.' if parent_key else ''}{close[0]}? " if close else ""
    where = f"under {parent_key}" if parent_key else "at the top level"
    raise ConfigError(f"{key}: no such key; {hint}valid keys {where}: {', '.join(valid)} (add new keys with +{key}=...)")
