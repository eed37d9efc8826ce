"""Read a user's DeepSpeed config (a JSON path or a dict) without changing it; write the one in effect."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def load_user_config(config: str | Path | Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """A private copy of the config, and how to name it in messages."""
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config)), "strategy.config"
    path = Path(config).expanduser()
    if not path.is_file():
        raise ValueError(
            f"strategy.config: {str(path)!r} is not a file; give the path of a DeepSpeed JSON config or a dict"
        )
    try:
        loaded = json.loads(path.read_text())
        too_deep = _depth(loaded) > MAX_DEPTH
    except json.JSONDecodeError as error:
        raise ValueError(
            f"strategy.config: {path} is not valid JSON ({error.msg} at line {error.lineno}, column {error.colno})"
        ) from None
    except RecursionError:  # deeper than Python's parser goes
        too_deep = True
    if too_deep:
        raise ValueError(f"strategy.config: {path} nests deeper than {MAX_DEPTH} levels; a DeepSpeed config has a few")
    if not isinstance(loaded, dict):
        raise TypeError(
            f"strategy.config: {path} holds a JSON {type(loaded).__name__}; a DeepSpeed config is a JSON object"
        )
    return loaded, f"strategy.config ({path.name})"


# DeepSpeed's deepest section is four levels down; copying and resolving recurse once per level.
MAX_DEPTH = 32


def _depth(node: Any) -> int:
    deepest, level = 0, [node]
    while level:
        deepest += 1
        level = [child for item in level if isinstance(item, (dict, list))
                 for child in (item.values() if isinstance(item, dict) else item)]
    return deepest - 1


def write_effective_config(
    config: dict[str, Any], directory: str | Path, name: str = "deepspeed_config.effective.json"
) -> Path:
    """The config DeepSpeed was given, for the record: sorted keys, no "auto" left."""
    path = Path(directory) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path
