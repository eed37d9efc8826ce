"""One-line errors for bad command-line overrides, found before Hydra runs the job (and so before any rank).

Hydra's own messages for these span several lines and do not list what would have been valid.
"""

from __future__ import annotations

import difflib
import importlib.util
from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

from lightning_dist.lifecycle.exits import REFUSED

# Inside the package, so that an installed lightning-dist has them (the repository's `conf/` links here).
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"  # lightning_dist/conf


class ConfigError(ValueError):
    """A configuration mistake, said in one line that names the key and the valid choices."""

    exit_code = REFUSED


def devices_per_node(devices: object) -> int:
    """`${ld.devices_per_node:${trainer.devices}}`: how many devices a node uses, from Lightning's `devices` (a
    count, a list or "0,1,..." of indices). A cluster job is sized before it reaches its nodes, so "auto" and -1
    (all devices found there) cannot size it."""
    if isinstance(devices, Sequence) and not isinstance(devices, str):
        count = len(devices)
    elif isinstance(devices, str) and "," in devices:
        count = len([index for index in devices.split(",") if index.strip()])
    else:
        try:
            count = int(devices)  # type: ignore[call-overload]  # whatever int() takes; the rest is refused
        except (TypeError, ValueError):
            count = -1
    if count < 1:
        raise ConfigError(
            f"trainer.devices={devices}: a SLURM job is sized before it reaches its nodes, so it cannot use auto or -1;"
            " set trainer.devices=N, the GPUs per node (one task each)"
        )
    return count


OmegaConf.register_new_resolver("ld.devices_per_node", devices_per_node, replace=True)
from lightning_dist.run import per_rank  # noqa: E402, F401  (its resolvers: where each rank writes its log and config)

# Launcher keys that size a cluster job; resolved before anything is submitted, so that a mistake is one line here
# rather than a traceback from inside Hydra's launcher.
_JOB_SIZE_KEYS = ("nodes", "tasks_per_node", "gpus_per_node")


def check_launcher(overrides: list[str], config_name: str = "train", conf_dir: Path = CONF_DIR) -> None:
    """Resolve the launcher's job size as Hydra will: from the config without the swept values."""
    parsed = parse_overrides(overrides)
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        cfg = compose(config_name, overrides=fixed, return_hydra_config=True)
    launcher = cfg.hydra.launcher
    for key in _JOB_SIZE_KEYS:
        if key not in launcher:
            continue
        try:
            launcher[key]
        except InterpolationResolutionError as error:
            cause = _config_error_behind(error)
            raise ConfigError(f"hydra.launcher.{key}: {cause or ' '.join(str(error).split())}") from None


def parse_overrides(overrides: list[str]) -> list:
    """Hydra's parse of each override, or ConfigError naming the first it cannot parse and how to quote it."""
    parser = OverridesParser.create()
    parsed = []
    for index, line in enumerate(overrides):
        try:
            parsed += parser.parse_overrides([line])
        except OverrideParseException as error:
            raise ConfigError(_unparsable(line, overrides[index - 1] if index else None, error)) from None
    return parsed


def _unparsable(line: str, previous: str | None, error: OverrideParseException) -> str:
    if "=" not in line and previous is not None and "=" in previous:  # the shell split a value at a space
        key, _, value = previous.partition("=")
        return (f"{line}: not an override (key=value); if it is the rest of {previous} after a space, quote the whole"
                f' value: "{key}=\'{value} {line}\'"')
    reason = str(error).splitlines()[0].strip()
    if reason.startswith("LexerNoViableAltException"):  # Hydra repeats the line, then a caret on the next one
        reason = "a character it takes only inside quotes"
    key, _, value = line.partition("=")
    return (f"{line}: Hydra cannot parse this override ({reason}); quote a value that has spaces, non-ASCII letters or"
            f" characters such as ! $ ( ) ' in it, for the shell as well: \"{key}='{value}'\"")


def _config_error_behind(error: BaseException | None) -> ConfigError | None:
    """Our own ConfigError from a resolver, however deep OmegaConf has wrapped it."""
    while error is not None and not isinstance(error, ConfigError):
        error = error.__cause__ or error.__context__
    return error


def group_options(group: str, conf_dir: Path | list[Path] = CONF_DIR) -> list[str]:
    conf_dirs = conf_dir if isinstance(conf_dir, list) else [conf_dir]
    return sorted({p.stem for directory in conf_dirs for p in (directory / group).glob("*.yaml")})


def _config_dirs(parsed: list, conf_dir: Path) -> list[Path]:
    """`conf_dir` and the directories a `hydra.searchpath=[file://...]` override adds (a recipe's configs)."""
    dirs = [conf_dir]
    for override in parsed:
        if override.key_or_group == "hydra.searchpath" and isinstance(override.value(), list):
            dirs += [Path(str(entry).removeprefix("file://")) for entry in override.value() if str(entry).startswith("file://")]
    return dirs


def check_overrides(overrides: list[str], config_name: str = "train", conf_dir: Path = CONF_DIR) -> DictConfig | None:
    """Compose the config with `overrides` and return it, or raise ConfigError for the first bad override.

    Sweeps (`strategy=ddp,fsdp`) get their group choices checked; each swept job is composed by Hydra itself.
    """
    parsed = parse_overrides(overrides)
    conf_dirs = _config_dirs(parsed, conf_dir)
    groups = {p.name for directory in conf_dirs if directory.is_dir() for p in directory.iterdir() if p.is_dir()}
    for override in parsed:
        key = override.key_or_group.split("@")[0]
        trainer_key = key.partition("trainer.")[2] if key.startswith("trainer.") else None
        if trainer_key in GROUPS_THE_TRAINER_IS_GIVEN and not override.is_delete():
            raise ConfigError(trainer_key_refusal(trainer_key, override.input_line.partition("=")[2]))
        if key in groups and override.is_delete():
            _check_group_can_go(key, conf_dirs)
        elif key in groups:
            values = list(override.sweep_string_iterator()) if override.is_sweep_override() else [override.value()]
            _check_group_choice(key, values, conf_dirs)
    if any(override.is_sweep_override() for override in parsed):
        return None

    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        try:
            return compose(config_name, overrides=overrides)
        except (HydraException, OmegaConfBaseException) as error:
            # Composed once where every override holds (each rank of a run composes its config again in Hydra's own
            # two passes); where one does not, a key that is not there is named first, with the keys beside it.
            _check_keys_exist(parsed, groups, config_name)
            raise ConfigError(" ".join(str(error).split())) from None


def _check_keys_exist(parsed: list, groups: set[str], config_name: str) -> None:
    """ConfigError for the first override of a key that the config composed with the group choices alone lacks."""
    group_overrides = [
        o.input_line
        for o in parsed
        if o.key_or_group.split("@")[0] in groups
        or o.key_or_group == "hydra.searchpath"
        or o.key_or_group.startswith("hydra/")
    ]
    try:
        base = compose(config_name, overrides=group_overrides)
    except (HydraException, OmegaConfBaseException):
        return  # the whole composition's own error says it
    for override in parsed:
        key = override.key_or_group
        # Hydra's own keys and groups (hydra/launcher=..., with options of Hydra's and ours) are Hydra's to check.
        hydras_own = key.startswith(("hydra.", "hydra/"))
        if key.split("@")[0] in groups or hydras_own or override.is_add() or override.is_delete():
            continue
        _check_key_exists(base, key)


# Options that need a package the base install does not bring: the modules they import, and how to get them.
_LOGGERS_EXTRA = 'pip install -e ".[loggers]"'
_HF_EXTRA = 'pip install -e ".[hf]"'
OPTION_PACKAGES: dict[tuple[str, str], tuple[tuple[str, ...], str]] = {
    ("logger", "tensorboard"): (("tensorboard",), _LOGGERS_EXTRA),
    ("logger", "wandb"): (("wandb",), _LOGGERS_EXTRA),
    ("logger", "mlflow"): (("mlflow",), _LOGGERS_EXTRA),
    ("logger", "many_loggers"): (("tensorboard", "wandb", "mlflow"), _LOGGERS_EXTRA),
    ("callbacks", "rich_progress_bar"): (("rich",), "pip install rich"),
    ("hparams_search", "optuna"): (("hydra_plugins.hydra_optuna_sweeper",), 'pip install -e ".[optuna]"'),
    ("optimizer", "lion"): (("lion_pytorch",), 'pip install -e ".[optimizers]"'),
    **{("model", name): (("transformers",), _HF_EXTRA) for name in ("hf_gpt2", "hf_llama", "hf_bart")},
    ("lora", "default"): (("transformers", "peft"), _HF_EXTRA),
}


# What the Trainer is given from groups of their own. The same key under `trainer` would be replaced by the group's
# without a word: `+trainer.strategy=fsdp` trained with ddp.
GROUPS_THE_TRAINER_IS_GIVEN = ("strategy", "callbacks", "logger")


def trainer_key_refusal(group: str, value: str) -> str:
    none = "" if group == "strategy" else f"; ~{group} for none"
    return (f"trainer.{group}={value}: the Trainer is given its {group} from the {group} group, in this key's place;"
            f" choose {group}=..., one of: {', '.join(group_options(group))}{none}")


# The groups no run goes without: `~strategy` composes, then the job fails on the missing node with a traceback.
REQUIRED_GROUPS = ("data", "model", "paths", "strategy", "trainer")


def _check_group_can_go(group: str, conf_dirs: list[Path]) -> None:
    """`~group` leaves a group out of the run: refused for one that every run needs."""
    if group in REQUIRED_GROUPS:
        choices = ", ".join(group_options(group, conf_dirs))
        raise ConfigError(f"~{group}: every run needs a {group}; choose one of: {choices}")


def _check_group_choice(group: str, values: list, conf_dirs: list[Path]) -> None:
    choices = group_options(group, conf_dirs)
    # A list selects several options at once (logger=[csv,tensorboard]); Hydra merges them.
    flat = [choice for value in values for choice in (value if isinstance(value, list) else [value])]
    for choice in flat:
        if choice is None:  # Hydra's own refusal is a traceback: "Config group override must be a string or a list"
            leave_out = "" if group in REQUIRED_GROUPS else f"; ~{group} leaves it out"
            raise ConfigError(f"{group}=null: a config group takes one of its options: {', '.join(choices)}{leave_out}")
        if str(choice) not in choices:
            raise ConfigError(f"{group}={choice}: no such option; {_hint(group, str(choice), choices, conf_dirs)}"
                              f"choose one of: {', '.join(choices)}")
        modules, install = OPTION_PACKAGES.get((group, str(choice)), ((), ""))
        missing = [module for module in modules if not _installed(module)]
        if missing:
            raise ConfigError(
                f"{group}={choice}: needs {', '.join(m.split('.')[-1] for m in missing)}, not installed here; {install}"
            )


# lightning-hydra-template's trainer options, which choose the strategy and devices there: here the strategy group does.
TEMPLATE_TRAINERS = {"ddp": "strategy=ddp trainer=gpu", "ddp_sim": "strategy=ddp trainer=cpu trainer.devices=2"}


def _hint(group: str, choice: str, choices: list[str], conf_dirs: list[Path]) -> str:
    """What a mistaken option was likely meant as: a close name in the group, lightning-hydra-template's trainer, or
    an option of another group (`trainer=fsdp`: a strategy)."""
    if close := difflib.get_close_matches(choice, choices, n=1):
        return f"did you mean {close[0]}? "
    if group == "trainer" and choice in TEMPLATE_TRAINERS:
        return f"lightning-hydra-template's trainer={choice} is {TEMPLATE_TRAINERS[choice]} here; "
    groups = sorted({path.parent.name for directory in conf_dirs for path in directory.glob(f"*/{choice}.yaml")})
    return f"{choice} is a {groups[0]} option ({groups[0]}={choice}); " if groups else ""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


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
    raise ConfigError(
        f"{key}: no such key; {hint}valid keys {where}: {', '.join(valid)} (add new keys with +{key}=...)"
    )
