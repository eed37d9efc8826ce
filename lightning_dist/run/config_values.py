"""Values refused before any rank starts, each in one line that names the key and what it must be.

Lightning, torch and the data module check most of these themselves, but only on every rank after launch, each rank
with its own traceback (`trainer.accumulate_grad_batches=0` is a ZeroDivisionError in the training loop), and some
not at all (a learning rate given as a string fails inside the optimizer). A rule is skipped where the config has no
such key: a user's own model or data module has its own arguments.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_dist.parallel.context_parallel import check_context_parallel
from lightning_dist.parallel.pipeline_layout import check_pipeline
from lightning_dist.parallel.pipeline_layout import dry_run_refusal as pipeline_dry_run_refusal
from lightning_dist.parallel.sizes import ParallelSizes
from lightning_dist.run.config_check import GROUPS_THE_TRAINER_IS_GIVEN, ConfigError, trainer_key_refusal
from lightning_dist.run.launch_world import launch_world_refusal
from lightning_dist.strategies.refusals import deepspeed_refusal, frozen_left_out_refusal

_ABSENT = object()


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def integer(at_least: int | None = None) -> Callable[[Any], bool]:
    return lambda value: _is_integer(value) and (at_least is None or value >= at_least)


def number(above: float | None = None, at_least: float | None = None) -> Callable[[Any], bool]:
    return lambda value: (_is_number(value) and (above is None or value > above)
                          and (at_least is None or value >= at_least))


def optional(valid: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or valid(value)


def _interval(value: Any) -> bool:
    """Lightning's `val_check_interval`: batches (an integer), a fraction of an epoch, or a duration ("00:01:00:00",
    a dict), which Lightning parses itself."""
    if isinstance(value, float):
        return 0 < value <= 1
    return value is None or isinstance(value, (str, dict, DictConfig)) or integer(1)(value)


def _devices(value: Any) -> bool:
    """Lightning's forms: "auto", -1 (every device), a count >= 1, indices as a list or a "0,1" string."""
    if value == "auto" or value == -1 or integer(1)(value):
        return True
    if OmegaConf.is_list(value) or isinstance(value, (list, tuple)):
        return len(value) > 0 and all(integer(0)(index) for index in value)
    if isinstance(value, str) and "," in value:  # "0,1": indices
        indices = [index.strip() for index in value.split(",") if index.strip()]
        return len(indices) > 0 and all(index.isdigit() for index in indices)
    if isinstance(value, str):  # "2": a count
        return value.strip().isdigit() and int(value) >= 1
    return False


def _betas(value: Any) -> bool:
    return (OmegaConf.is_list(value) or isinstance(value, (list, tuple))) and len(value) == 2 and all(
        _is_number(beta) and 0 <= beta < 1 for beta in value)


@dataclass(frozen=True)
class Rule:
    key: str
    must_be: str  # said in the error, after "must be"
    valid: Callable[[Any], bool]


RULES = (
    Rule(
        "resume",
        "true, false or run_dir (the newest whole checkpoint in hydra.run.dir only: a requeued job's)",
        lambda value: isinstance(value, bool) or value == "run_dir",
    ),
    Rule(
        "ckpt_path",
        "a checkpoint's path (a file or a directory), or null to train from scratch; empty is what `ckpt_path=$VAR`"
        " gives with VAR unset",
        lambda value: value is None or (isinstance(value, str) and value.strip() != ""),
    ),
    Rule("train", "true or false (false: test only, on ckpt_path's weights)", lambda value: isinstance(value, bool)),
    Rule("test", "true or false (true: the test split after fitting)", lambda value: isinstance(value, bool)),
    Rule("seed", "an integer", integer()),
    Rule(
        "compile",
        "true or false (true: each block of the model compiled with torch.compile)",
        lambda value: isinstance(value, bool),
    ),
    Rule(
        "dry_run",
        "true or false (true: the run set up and stepped on fake devices at its world size)",
        lambda value: isinstance(value, bool),
    ),
    Rule(
        "dry_run_ranks",
        "null or a list of global ranks (integers >= 0)",
        optional(
            lambda value: (
                (OmegaConf.is_list(value) or isinstance(value, (list, tuple)))
                and len(value) > 0
                and all(integer(0)(rank) for rank in value)
            )
        ),
    ),
    Rule("dry_run_device_memory_gb", "a number of GB above 0 (one device's memory)", number(above=0)),
    Rule(
        "checkpoint.async",
        "true or false (true: checkpoints written in the background)",
        lambda value: isinstance(value, bool),
    ),
    Rule("trainer.max_steps", "an integer >= -1 (-1: no limit)", integer(-1)),
    Rule("trainer.max_epochs", "null or an integer >= -1 (-1: no limit)", optional(integer(-1))),
    Rule("trainer.min_steps", "null or an integer >= 0", optional(integer(0))),
    Rule("trainer.accumulate_grad_batches", "an integer >= 1 (batches per optimizer step)", integer(1)),
    Rule(
        "trainer.val_check_interval",
        "null, an integer >= 1 (training batches), a fraction in (0, 1] of an epoch, or a duration",
        _interval,
    ),
    Rule("trainer.check_val_every_n_epoch", "null or an integer >= 1", optional(integer(1))),
    Rule("trainer.log_every_n_steps", "an integer >= 0", integer(0)),
    Rule("trainer.num_sanity_val_steps", "an integer >= -1 (-1: every batch)", integer(-1)),
    Rule("trainer.num_nodes", "an integer >= 1", integer(1)),
    Rule("trainer.devices", 'an integer >= 1 (devices per node), -1 (every one), "auto", or device indices ([0, 1])',
         _devices),
    Rule("trainer.gradient_clip_val", "null or a number >= 0", optional(number(at_least=0))),
    Rule(
        "strategy.tensor_parallel_size",
        "null (DeepSpeed: the config file's), an integer >= 1, or -1 (the ranks that are left)",
        optional(lambda value: value == -1 or integer(1)(value)),
    ),
    Rule(
        "strategy.data_parallel_replicate_size",
        "null, an integer >= 1, or -1 (the ranks that are left)",
        optional(lambda value: value == -1 or integer(1)(value)),
    ),
    Rule("data.batch_size", "an integer >= 1 (samples per rank and step)", integer(1)),
    Rule("data.num_workers", "an integer >= 0", integer(0)),
    Rule("model.optimizer.lr", "a number > 0", number(above=0)),
    Rule("model.lr", "a number > 0", number(above=0)),  # a module that takes its learning rate itself
    Rule("model.optimizer.weight_decay", "a number >= 0", number(at_least=0)),
    Rule("model.optimizer.eps", "a number > 0", number(above=0)),
    Rule("model.optimizer.momentum", "a number >= 0", number(at_least=0)),
    Rule("model.optimizer.betas", "two numbers in [0, 1), as [0.9, 0.95]", _betas),
)


def check_values(cfg: DictConfig, rules: tuple[Rule, ...] = RULES) -> None:
    """ConfigError for the first value a rule refuses (or that cannot be resolved), naming its key; then for
    values each valid that cannot run together."""
    for rule in rules:
        value = _value(cfg, rule.key)
        if value is not _ABSENT and not rule.valid(value):
            raise ConfigError(f"{rule.key}={_as_typed(cfg, rule.key, value)}: must be {rule.must_be}")
    _check_trainer_leaves_the_groups_theirs(cfg)
    check_combinations(cfg)


def _check_trainer_leaves_the_groups_theirs(cfg: DictConfig) -> None:
    """A trainer config of the user's own (lightning-hydra-template's trainer/ddp.yaml sets `strategy: ddp`)."""
    for group in GROUPS_THE_TRAINER_IS_GIVEN:
        value = _value(cfg, f"trainer.{group}")
        if value is not _ABSENT:
            raise ConfigError(trainer_key_refusal(group, _as_typed(cfg, f"trainer.{group}", value)))


# The dry run sets up and steps its ranks in one process, and its cost grows with the world size (DeepSpeed
# partitions every parameter over all ranks): the 7B ZeRO-3 dry run at 64 ranks takes 2 to 6 minutes on our 2-core
# machines. Past this it would run for hours; the planner (`plan=true`) answers for any size.
DRY_RUN_MAX_RANKS = 1024
# CPU ranks per core a node may start: each rank is a process with its own torch (about 0.3 GB before any model),
# and past a few per core they only take turns (the suite's 8-rank runs on 2 cores are 4 per core). Beyond this, a
# typo (trainer.devices=100) would start that many processes and fill the node's memory.
CPU_RANKS_PER_CORE = 8
_STRATEGIES = "lightning_dist.strategies."


def check_combinations(cfg: DictConfig) -> None:
    """What the strategy would refuse once started, from the config alone (no torch): the same checks, in the
    same words, in well under a second and before Lightning has printed anything."""
    if _value(cfg, "train") is False and _value(cfg, "test") is False:
        raise ConfigError("train=false and test=false: nothing to run; train=false test=true ckpt_path=CHECKPOINT tests"
                          " a checkpoint")
    devices, nodes = _device_count(_value(cfg, "trainer.devices")), _value(cfg, "trainer.num_nodes")
    ranks = devices * nodes if devices is not None and _is_integer(nodes) else None
    if _value(cfg, "dry_run") is True and ranks is not None and ranks > DRY_RUN_MAX_RANKS:
        raise ConfigError(f"dry_run=true: {ranks} ranks (trainer.devices x trainer.num_nodes); the dry run steps its"
                          f" ranks in this process, up to {DRY_RUN_MAX_RANKS}. For a larger world, plan=true says"
                          " what each rank holds")
    simulated = _value(cfg, "dry_run") is True or _value(cfg, "plan") is True  # a GPU run planned or checked here
    if _value(cfg, "trainer.accelerator") in ("gpu", "cuda") and not simulated and not _has_nvidia_gpu():
        raise ConfigError("trainer.accelerator=gpu: this machine has no NVIDIA GPU (no driver device in /dev); train on"
                          " its CPU with trainer=cpu, or check the GPU run without one with dry_run=true")
    if not simulated and (refusal := launch_world_refusal(devices, nodes if _is_integer(nodes) else None)):
        raise ConfigError(refusal)
    cores = len(os.sched_getaffinity(0))
    if (_value(cfg, "trainer.accelerator") == "cpu" and not simulated and devices is not None
            and devices > CPU_RANKS_PER_CORE * cores):
        raise ConfigError(f"trainer.devices={devices}: {devices} CPU ranks on a node with {cores} cores; each is a"
                          f" process of its own, so at most {CPU_RANKS_PER_CORE * cores} here ({CPU_RANKS_PER_CORE}"
                          " per core); choose fewer, or check a larger world without training with dry_run=true")
    strategy = _value(cfg, "strategy")
    target = strategy.get("_target_") if isinstance(strategy, DictConfig) else None
    if target in (f"{_STRATEGIES}DeepSpeedStrategy", f"{_STRATEGIES}deepspeed.DeepSpeedStrategy"):
        stage = strategy.get("stage")
        if stage is None and strategy.get("config") is None:
            stage = 2  # the strategy's default without a config file; with one, the file's (known after launch)
        refusal = deepspeed_refusal(stage, strategy.get("activation_checkpointing") == "ops",
                                    strategy.get("async_checkpoint") is True)
        refusal = refusal or frozen_left_out_refusal(strategy.get("exclude_frozen_parameters") is True,
                                                     tensor_parallel_size=strategy.get("tensor_parallel_size"),
                                                     expert_parallel_size=strategy.get("expert_parallel_size"))
        if refusal:
            raise ConfigError(refusal)
        cp = strategy.get("context_parallel_size")
        if _is_integer(cp):  # DeepSpeed's Ulysses exchanges heads as all_to_all does
            try:
                check_context_parallel(cp, "all_to_all", _integer_or_none(_value(cfg, "model.n_head")),
                                       _integer_or_none(_value(cfg, "data.block_size")), _device_type(cfg), world=ranks)
            except ValueError as error:
                raise ConfigError(str(error)) from None
    elif target in (f"{_STRATEGIES}FSDPStrategy", f"{_STRATEGIES}fsdp.FSDPStrategy") and devices and ranks is not None:
        if refusal := frozen_left_out_refusal(strategy.get("exclude_frozen_parameters") is True,
                                              pipeline_parallel_size=strategy.get("pipeline_parallel_size"),
                                              expert_parallel_size=strategy.get("expert_parallel_size")):
            raise ConfigError(refusal)
        try:
            sizes = ParallelSizes.from_config(strategy)
            # Without other axes the sequence-parallel groups divide every rank: the sizes suggested divide them too.
            alone = (sizes.tensor, sizes.pipeline) == (1, 1) and sizes.replicate in (None, 1) and not sizes.hybrid
            check_context_parallel(sizes.context, strategy.get("context_parallel", "all_to_all"),
                                   _integer_or_none(_value(cfg, "model.n_head")),
                                   _integer_or_none(_value(cfg, "data.block_size")), _device_type(cfg),
                                   sizes.tensor if _is_integer(sizes.tensor) else 1, world=ranks if alone else None)
            if sizes.pipeline != 1:
                _check_pipeline(cfg, strategy)
                refusal = pipeline_dry_run_refusal(strategy.get("pipeline_schedule", "1F1B"))
                if _value(cfg, "dry_run") is True and refusal:
                    raise ValueError(f"dry_run=true: {refusal}")
            sizes.check(devices, nodes)
        except ValueError as error:
            raise ConfigError(str(error)) from None


def _check_pipeline(cfg: DictConfig, strategy: DictConfig) -> None:
    """The pipeline's settings against the model's blocks (`model.n_layer`, where the model config has it) and the
    batch (`data.batch_size`): ValueError in one line naming the key."""
    blocks, batch_size = _value(cfg, "model.n_layer"), _value(cfg, "data.batch_size")
    stages_per_rank, microbatches = strategy.get("stages_per_rank", 1), strategy.get("microbatches")
    pp = strategy.get("pipeline_parallel_size")
    if microbatches is None:  # the strategy's default: one per stage
        microbatches = pp * stages_per_rank if _is_integer(pp) and _is_integer(stages_per_rank) else 1
    check_pipeline(pp, stages_per_rank, strategy.get("pipeline_schedule", "1F1B"), microbatches,
                   blocks if _is_integer(blocks) else None, batch_size if _is_integer(batch_size) else None)


def _integer_or_none(value: Any) -> int | None:
    return value if _is_integer(value) else None


def _device_type(cfg: DictConfig) -> str | None:
    """"cpu" or "cuda" where the config says it (an accelerator of "auto" is decided by Lightning)."""
    accelerator = _value(cfg, "trainer.accelerator")
    return {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda"}.get(accelerator) if isinstance(accelerator, str) else None


def _has_nvidia_gpu() -> bool:
    """Whether a GPU's driver shows a device here, asked without torch (which takes seconds to load): NVIDIA's device
    files, which every process that can use one sees (a container is given them with the GPU), or WSL2's. Not asked
    on a Mac, whose `gpu` is Metal."""
    return (sys.platform == "darwin" or Path("/dev/nvidiactl").exists() or Path("/dev/dxg").exists()
            or any(Path("/dev").glob("nvidia[0-9]*")))


def _device_count(devices: Any) -> int | None:
    """How many devices a node uses, where the config says it (not "auto" or -1: Lightning counts those)."""
    if OmegaConf.is_list(devices) or isinstance(devices, (list, tuple)):
        return len(devices) or None
    if isinstance(devices, str) and "," in devices:
        return len([index for index in devices.split(",") if index.strip()]) or None
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    return devices if _is_integer(devices) and devices >= 1 else None


def _value(cfg: DictConfig, key: str) -> Any:
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    if not isinstance(parent, DictConfig) or leaf not in parent:
        return _ABSENT
    try:
        return parent[leaf]
    except OmegaConfBaseException as error:  # an interpolation that does not resolve: ${oc.env:UNSET}
        raise ConfigError(f"{key}: {' '.join(str(error).splitlines()[0].split())}") from None


def _as_typed(cfg: DictConfig, key: str, value: Any) -> str:
    """The value, and what it was written as where that was an interpolation: `${oc.env:HOME} (= /root)`."""
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    if OmegaConf.is_config(value):
        shown = OmegaConf.to_container(value)
    elif isinstance(value, str) and (value == "" or value.strip() != value):
        shown = repr(value)  # so that an empty or padded string is seen as one
    else:
        shown = value
    if OmegaConf.is_interpolation(parent, leaf):
        typed = OmegaConf.to_container(parent, resolve=False)
        return f"{typed[leaf]} (= {shown})"  # type: ignore[index,call-overload]  # `parent` holds `leaf`
    return str(shown)
