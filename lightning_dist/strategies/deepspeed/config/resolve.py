"""Fill a DeepSpeed config's "auto" values from the run's facts and report every value that contradicts them.

In the spirit of Hugging Face's `HfTrainerDeepSpeedConfig.fill_match`: "auto" (and, for the keys the Trainer owns,
an absent key) takes the Trainer's value; an explicit value must agree with it. All problems are collected and
raised together, key by key, so one run of the command shows everything to fix.

Optimizer precedence: a file with an `optimizer` block builds the optimizer (Lightning then does not call
`configure_optimizers`); its "auto" values are copied from the optimizer `configure_optimizers` returns, and its
explicit values win. Without an `optimizer` block, `configure_optimizers` is the optimizer.
"""

from __future__ import annotations

import copy
import difflib
import json
from dataclasses import dataclass, field
from typing import Any

from lightning_dist.memory.hidden_size import HIDDEN_SIZE_NAMES
from lightning_dist.parallel.precision import PRECISIONS
from lightning_dist.strategies.deepspeed.config.facts import UNKNOWN, TrainingFacts
from lightning_dist.strategies.deepspeed.config.outputs import missing_monitor_packages
from lightning_dist.strategies.deepspeed.config.zero import ZeroSection, nvme_path_missing, parameter_offload_problem

AUTO = "auto"
_ABSENT = object()

_OPTIMIZER_PARAMS = ("lr", "betas", "eps", "weight_decay")
_SCHEDULER_PARAMS = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")
HIDDEN_SIZE_RULES = {  # HF's rules: per-bucket element counts from the hidden size h
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}
FILLED_KEYS = (
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "train_batch_size",
    "gradient_clipping",
    "managed_gradient_accumulation",
    "fp16.enabled",
    "bf16.enabled",
    *(f"optimizer.params.{name}" for name in _OPTIMIZER_PARAMS),
    *(f"scheduler.params.{name}" for name in _SCHEDULER_PARAMS),
    *(f"zero_optimization.{name}" for name in HIDDEN_SIZE_RULES),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
)


@dataclass(frozen=True)
class ZeroOptions:
    """The strategy's own arguments; None means "not asked for", so the file decides."""

    stage: int | None = None
    offload_optimizer: str | None = None
    offload_parameters: str | None = None
    nvme_path: str | None = None
    tensor_parallel_size: int | None = None  # DeepSpeed AutoTP: tensor_parallel.autotp_size
    context_parallel_size: int | None = None  # Ulysses: sequence_parallel_size
    expert_parallel_size: int | None = None  # AutoEP: expert_parallel.autoep_size


def buckets_sized_by_model(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with ZeRO-3's reduce bucket set to "auto", so it follows the model's hidden size by the rule of
    Hugging Face's files (`HIDDEN_SIZE_RULES`) rather than DeepSpeed's fixed default: a 2e8-element bucket is
    allocated whole, 800 MB per rank in fp32, whatever the model's size. (The prefetch bucket and persistence
    threshold keep DeepSpeed's values: sized by the same rule, DeepSpeed 0.19.8 tried to re-partition a parameter
    still being prefetched when validation followed training.)"""
    config = copy.deepcopy(config)
    zero = config.setdefault("zero_optimization", {})
    if zero.get("stage") == 3:
        zero["reduce_bucket_size"] = AUTO
    return config


class DeepSpeedConfigError(ValueError):
    """Every contradiction and unresolvable "auto" in a DeepSpeed config, one `key: reason` per problem."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.problems = problems
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        super().__init__(f"{source}: {count}: " + " | ".join(problems))


# How alike (difflib's ratio) an unknown key and a DeepSpeed one must be for the unknown one to be a misspelling:
# zero_optimisation/zero_optimization 0.94, but LLaMA-Factory's comms_config/comms_logger 0.67.
_MISSPELT = 0.8

# Lightning's defaults: a Trainer that still has them was not told, so a file's explicit value is a choice, not a
# contradiction (the unset-vs-explicit rule; docs/deepspeed-configs.md).
UNSET_PRECISION = "32-true"
UNSET_ACCUMULATION = 1


@dataclass
class Resolution:
    """The config DeepSpeed gets, the Trainer settings the file decided, and one line per such decision."""

    config: dict[str, Any]
    trainer_settings: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def resolve_config(
    config: dict[str, Any], facts: TrainingFacts, options: ZeroOptions = ZeroOptions(), source: str = "strategy.config"
) -> dict[str, Any]:
    """The config DeepSpeed gets (see `resolve`)."""
    return resolve(config, facts, options, source).config


def resolve(
    config: dict[str, Any], facts: TrainingFacts, options: ZeroOptions = ZeroOptions(), source: str = "strategy.config"
) -> Resolution:
    """A copy of the config with every fillable "auto" filled, and the Trainer settings that the file's explicit
    values decide where the Trainer left them unset. Facts that are still UNKNOWN leave their keys as they are, for
    the in-rank pass to fill."""
    resolver = _Resolver(copy.deepcopy(config), facts, source)
    resolver.refuse_unknown_keys()
    resolver.merge_zero_options(options)
    resolver.check_tensor_parallel(options.tensor_parallel_size)
    resolver.check_sequence_parallel(options.context_parallel_size)
    resolver.check_expert_parallel(options.expert_parallel_size)
    resolver.fill_precision()
    resolver.fill_batch_sizes()
    resolver.fill_accumulation_boundary()
    resolver.fill_clipping()
    resolver.fill_optimizer_and_scheduler()
    resolver.fill_bucket_sizes()
    resolver.report_unfillable_autos()
    resolver.validate_zero_section()
    resolver.problems += missing_monitor_packages(resolver.config)
    if resolver.problems:
        raise DeepSpeedConfigError(source, resolver.problems)
    return Resolution(resolver.config, resolver.trainer_settings, resolver.notes)


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _show(value: Any) -> str:
    return (
        json.dumps(value)
        if isinstance(value, (str, bool, list, tuple)) or value is None
        else f"{value:g}"
        if isinstance(value, float)
        else str(value)
    )


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(a - b) <= 1e-12 * max(1.0, abs(a), abs(b))
    return a == b


class _Resolver:
    def __init__(self, config: dict[str, Any], facts: TrainingFacts, source: str = "strategy.config") -> None:
        self.config = config
        self.facts = facts
        self.source = source
        self.problems: list[str] = []
        self.notes: list[str] = []
        self.trainer_settings: dict[str, Any] = {}
        self.deferred: set[str] = set()  # "auto"s whose fact is not known yet (before spawn)
        self.unfillable: set[str] = set()  # "auto"s already reported

    # -- dotted-key access ------------------------------------------------------------------------------------
    def get(self, key: str, default: Any = _ABSENT) -> Any:
        node: Any = self.config
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def set(self, key: str, value: Any) -> None:
        *parents, leaf = key.split(".")
        node = self.config
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value

    def fill_match(self, key: str, value: Any, trainer_says: str, fill_absent: bool = True, fix: str = "") -> None:
        """"auto" (or absent, when `fill_absent`) becomes `value`; an explicit value must equal it."""
        current = self.get(key)
        if value is UNKNOWN:
            if current == AUTO:
                self.deferred.add(key)
            return
        if current == AUTO or (current is _ABSENT and fill_absent):
            self.set(key, value)
        elif current is not _ABSENT and not _equal(current, value):
            fix = fix or f'set it to "auto" or {_show(value)}'
            self.problems.append(f"{key}={_show(current)} but {trainer_says} ({fix})")

    def fill_auto(self, key: str, value: Any, unresolvable_because: str | None = None) -> None:
        """Only "auto" is filled (explicit values are the user's choice); None with a reason: cannot be filled."""
        if self.get(key) != AUTO:
            return
        if value is UNKNOWN:
            self.deferred.add(key)
        elif value is None:
            self.unfillable.add(key)
            self.problems.append(f'{key}="auto" cannot be filled: {unresolvable_because}; set a value')
        else:
            self.set(key, value)

    # -- the rules ------------------------------------------------------------------------------------------
    def merge_zero_options(self, options: ZeroOptions) -> None:
        zero_key = "zero_optimization"
        if options.stage is not None:
            self.fill_match(
                f"{zero_key}.stage", options.stage, f"strategy.stage={options.stage}", fix="make them agree"
            )
        for block, option_name, device in (
            ("offload_optimizer", "offload_optimizer", options.offload_optimizer),
            ("offload_param", "offload_parameters", options.offload_parameters),
        ):
            key = f"{zero_key}.{block}"
            in_file = self.get(f"{key}.device", None)
            in_file = None if in_file in (None, "none") else in_file
            if device is not None and in_file is None:
                self.set(f"{key}.device", device)
            elif device is not None and in_file != device:
                self.problems.append(
                    f"{key}.device={_show(in_file)} but strategy.{option_name}={device} (make them agree)"
                )
            if self.get(f"{key}.device", None) == "nvme":
                self._fill_nvme_path(key, options.nvme_path)
        zero = ZeroSection.of(self.config)
        problem = parameter_offload_problem(
            zero.stage, zero.parameters.device, f"{zero_key}.stage", f"{zero_key}.offload_param"
        )
        if problem:
            self.problems.append(problem)

    def _fill_nvme_path(self, key: str, nvme_path: str | None) -> None:
        in_file = self.get(f"{key}.nvme_path", None)
        if in_file is None and nvme_path:
            self.set(f"{key}.nvme_path", str(nvme_path))
        elif in_file is None:
            self.problems.append(nvme_path_missing(f"{key}.nvme_path", f"{key}.nvme_path or strategy.nvme_path"))
        elif nvme_path and str(in_file) != str(nvme_path):
            self.problems.append(
                f"{key}.nvme_path={_show(in_file)} but strategy.nvme_path={nvme_path} (make them agree)"
            )

    def decide(self, setting: str, value: Any, key: str) -> None:
        """The file's explicit `key` decides a Trainer setting the Trainer left unset."""
        self.trainer_settings[setting] = value
        self.notes.append(
            f"trainer.{setting}={value} comes from {key}={_show(self.get(key))} in {self.source}; the Trainer sets none"
        )

    def fill_precision(self) -> None:
        precision = self.facts.precision
        if precision not in PRECISIONS:
            self.problems.append(f"trainer.precision={precision}: DeepSpeed trains in one of {', '.join(PRECISIONS)}")
            return
        said = f"trainer.precision={precision}"
        if precision == UNSET_PRECISION:
            for key, mixed in (("fp16.enabled", "16-mixed"), ("bf16.enabled", "bf16-mixed")):
                if self.get(key) is True:
                    self.decide("precision", mixed, key)
                    precision, said = mixed, f"{key}=true"
                    break
        wants_fp16, wants_bf16 = precision.startswith("16-"), precision.startswith("bf16-")
        # An absent flag means disabled to DeepSpeed, so only a needed one is added.
        self.fill_match("fp16.enabled", wants_fp16, said, fill_absent=wants_fp16)
        self.fill_match("bf16.enabled", wants_bf16, said, fill_absent=wants_bf16)
        if wants_fp16 and not self.facts.fp16_supported:
            fix = (
                "choose 32-true, bf16-mixed or bf16-true"
                if said.startswith("trainer.")
                else 'set it to "auto" or false'
            )
            self.problems.append(
                f"{said}: this {self.facts.device_type.upper()} has no fp16 support in DeepSpeed (its CPU accelerator"
                f" needs AVX512-FP16/AMX-FP16); {fix}, or run on CUDA"
            )

    def fill_batch_sizes(self) -> None:
        facts = self.facts
        micro = facts.micro_batch_size if facts.micro_batch_size is not None else 1
        self.fill_match("train_micro_batch_size_per_gpu", micro, f"the train loader's batch size is {micro}")
        accumulate = facts.accumulate_grad_batches
        in_file = self.get("gradient_accumulation_steps")
        if (
            accumulate == UNSET_ACCUMULATION
            and isinstance(in_file, int)
            and not isinstance(in_file, bool)
            and in_file > 1
        ):
            self.decide("accumulate_grad_batches", in_file, "gradient_accumulation_steps")
            accumulate = in_file
        self.fill_match("gradient_accumulation_steps", accumulate, f"trainer.accumulate_grad_batches={accumulate}")
        if micro is UNKNOWN:
            self.fill_match("train_batch_size", UNKNOWN, "")
            return
        # Over every rank, AutoTP's too: DeepSpeed 0.19.8 checks the batch sizes before it forms tensor-parallel groups.
        # The ranks of a sequence-parallel group share one batch, and DeepSpeed counts them once (config.py).
        sequence_parallel = self.sequence_parallel_size
        if sequence_parallel > 1:
            ranks = facts.world_size // sequence_parallel
            said = f"(world size / sequence_parallel_size) = {micro} x {accumulate} x {ranks}"
        else:
            ranks, said = facts.world_size, f"world size = {micro} x {accumulate} x {facts.world_size}"
        total = micro * accumulate * ranks
        self.fill_match("train_batch_size", total, f"micro batch x accumulation x {said} = {total}", fill_absent=False)

    def fill_accumulation_boundary(self) -> None:
        """Who ends a step's gradient accumulation. Lightning does under our strategy (`handles_gradient_accumulation`
        is False): every `accumulate_grad_batches` batches and at each epoch's last batch, or the module's own
        `opt.step()` under manual optimization. DeepSpeed's own count of backwards (`managed`, its default) carried an
        epoch's last batches into the next epoch's first step, out of line with Lightning's step count, its scheduler
        and `max_steps`; and ZeRO-1/2, counting each backward of a manual step as one, kept only the last one's
        gradients. So where a step may have several backwards, each `step()` ends the accumulation."""
        key, in_file = "managed_gradient_accumulation", self.get("managed_gradient_accumulation")
        accumulate = self.get("gradient_accumulation_steps")
        if self.facts.manual_optimization:
            who = "the module steps its optimizer itself (automatic_optimization=False)"
        elif isinstance(accumulate, int) and accumulate > 1:
            who = f"Lightning ends each accumulation of {accumulate} batches, and at an epoch's last batch"
        else:  # one backward a step: each backward ends it either way
            if in_file == AUTO:
                self.set(key, True)
            return
        if in_file is True:
            self.problems.append(f"{key}=true but {who}: DeepSpeed's own count of backwards would end steps elsewhere "
                                 '(set it to "auto" or false)')
            return
        if in_file in (_ABSENT, AUTO):
            self.set(key, False)
        stage = ZeroSection.of(self.config).stage
        if stage in (0, 1) and self.get("zero_optimization.overlap_comm") is True:
            # DeepSpeed refuses the pair: ZeRO-0/1 reduce in step() then, with no backward to overlap it with.
            self.set("zero_optimization.overlap_comm", False)
            self.notes.append(f"zero_optimization.overlap_comm=false: under {key}=false ({who}) ZeRO-{stage} "
                              "reduces the gradients in step(), with no backward to overlap")

    def fill_clipping(self) -> None:
        clip_val, algorithm = self.facts.gradient_clip_val, self.facts.gradient_clip_algorithm
        if clip_val and algorithm == "value":
            self.problems.append(
                "trainer.gradient_clip_algorithm=value: DeepSpeed clips by norm only; choose "
                "gradient_clip_algorithm=norm"
            )
        in_file = self.get("gradient_clipping")
        if clip_val is None and in_file not in (_ABSENT, AUTO):
            # The Trainer left clipping unset: the file's explicit value is a choice, not a contradiction.
            self.notes.append(
                f"gradient_clipping={_show(in_file)} comes from {self.source}; the Trainer sets no gradient_clip_val"
            )
            return
        self.fill_match("gradient_clipping", float(clip_val or 0.0), f"trainer.gradient_clip_val={clip_val}")

    def fill_optimizer_and_scheduler(self) -> None:
        module_optimizer = self.facts.optimizer
        if "optimizer" in self.config:
            for name in _OPTIMIZER_PARAMS:
                self.fill_auto(f"optimizer.params.{name}", *_copied_from(module_optimizer, name))
        if "scheduler" not in self.config:
            return
        lr = self.get("optimizer.params.lr")
        peak_lr = _copied_from(module_optimizer, "lr") if lr in (_ABSENT, AUTO) else (lr, None)
        self.fill_auto("scheduler.params.warmup_min_lr", 0.0)
        self.fill_auto("scheduler.params.warmup_max_lr", *peak_lr)
        # DeepSpeed's warm-up schedulers refuse 0 steps; 1 is its "no warm-up".
        self.fill_auto("scheduler.params.warmup_num_steps", max(1, self.facts.warmup_steps))
        self.fill_auto("scheduler.params.total_num_steps", self.facts.total_steps, "the Trainer has no max_steps")

    def fill_bucket_sizes(self) -> None:
        hidden = self.facts.hidden_size
        why = f"they follow the model's hidden size, and its hparams have none of {', '.join(HIDDEN_SIZE_NAMES)}"
        for name, rule in HIDDEN_SIZE_RULES.items():
            self.fill_auto(f"zero_optimization.{name}", None if hidden is None else rule(hidden), why)
        # Only DeepSpeed's save_16bit_model reads it; our checkpoints gather (or consolidate) the fp32 weights.
        self.fill_auto("zero_optimization.stage3_gather_16bit_weights_on_model_save", False)

    def refuse_unknown_keys(self) -> None:
        # DeepSpeed passes over a top-level key it does not read, so a misspelt section (zero_optimisation) would
        # silently switch its feature off: refused. Keys nothing like DeepSpeed's are other tools' (public files
        # carry some, as LLaMA-Factory's `comms_config`) and are ignored, as DeepSpeed does, but said.
        import deepspeed

        from lightning_dist._compat.deepspeed import top_level_config_keys

        # sequence_parallel_size: DeepSpeed reads it once a process group is up, which the recording parse has not.
        known = sorted(top_level_config_keys() | {"sequence_parallel_size"})
        for key in sorted(set(self.config) - set(known), key=str):
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=_MISSPELT)
            if close:
                self.problems.append(
                    f"{key}: DeepSpeed {deepspeed.__version__} reads no such top-level key (it would ignore the"
                    f" section); did you mean {close[0]}?"
                )
            else:
                self.notes.append(
                    f"{self.source}: {key} is not a DeepSpeed {deepspeed.__version__} key; ignored, as DeepSpeed does"
                )

    def check_tensor_parallel(self, option: int | None) -> None:
        """DeepSpeed AutoTP: `strategy.tensor_parallel_size` and the file's `tensor_parallel.autotp_size` agree, and
        the size divides the world into data-parallel ranks (each tensor-parallel group shares one batch)."""
        key = "tensor_parallel.autotp_size"
        if option == -1:  # the ranks that are left: every rank, as ZeRO then has one data-parallel rank
            option = self.facts.world_size
        if option is not None:
            self.fill_match(key, option, f"strategy.tensor_parallel_size={option}", fix="make them agree")
        size = self.get(key, None)
        if size in (None, 0):  # DeepSpeed's default: no tensor parallelism
            return
        world = self.facts.world_size
        divisors = [n for n in range(1, world + 1) if world % n == 0]
        if isinstance(size, bool) or not isinstance(size, int) or size < 1 or world % size:
            said = f"strategy.tensor_parallel_size={option}" if option == size else f"{key}={_show(size)}"
            self.problems.append(f"{said}: the {world} ranks do not divide into tensor-parallel groups of that size;"
                                 f" choose one of {', '.join(map(str, divisors))}")

    @property
    def sequence_parallel_size(self) -> int:
        size = self.get("sequence_parallel_size", 1)
        return size if _is_size(size) and self.facts.world_size % size == 0 else 1

    def check_sequence_parallel(self, option: int | None) -> None:
        """Ulysses: `strategy.context_parallel_size` and the file's `sequence_parallel_size` (the key DeepSpeed and
        Hugging Face's sequence parallelism read) agree; the size divides the world into data-parallel ranks (each
        group shares one batch); AutoTP is not beside it."""
        key = "sequence_parallel_size"
        if option is not None:
            self.fill_match(key, option, f"strategy.context_parallel_size={option}", fill_absent=option > 1,
                            fix="make them agree")
        size = self.get(key, None)
        if size in (None, 1):
            return
        said = f"strategy.context_parallel_size={option}" if option == size else f"{key}={_show(size)}"
        divides = self.divides_the_ranks(size, said, "sequence-parallel")
        if divides and self.get("tensor_parallel.autotp_size", 0) not in (0, 1):
            self.problems.append(f"{said}: DeepSpeed's AutoTP (tensor_parallel.autotp_size) does not run beside"
                                 " sequence parallelism here; choose one of the two")

    def divides_the_ranks(self, size: Any, said: str, groups: str) -> bool:
        """Whether `size` divides the ranks into groups; a problem naming the sizes that would where it does not."""
        world = self.facts.world_size
        if _is_size(size) and world % size == 0:
            return True
        divisors = [n for n in range(1, world + 1) if world % n == 0]
        self.problems.append(f"{said}: the {world} ranks do not divide into {groups} groups of that size; choose one"
                             f" of {', '.join(map(str, divisors))}")
        return False

    def check_expert_parallel(self, option: int | None) -> None:
        """AutoEP: `strategy.expert_parallel_size` and the file's `expert_parallel` section agree (the option turns
        the section on); the size divides the ranks; neither AutoTP nor sequence parallelism is beside it."""
        key = "expert_parallel.autoep_size"
        enabled = self.get("expert_parallel.enabled", False) is True
        if option is not None and (option > 1 or enabled):
            said = f"strategy.expert_parallel_size={option}"
            self.fill_match(key, option, said, fix="make them agree")
            if self.get("expert_parallel.enabled", _ABSENT) is _ABSENT:
                self.set("expert_parallel.enabled", True)
            elif not enabled:
                self.problems.append(f"expert_parallel.enabled=false but {said} (make them agree)")
                return
        if self.get("expert_parallel.enabled", False) is not True:
            return
        size = self.get(key, 1)
        said = f"strategy.expert_parallel_size={option}" if option == size else f"{key}={_show(size)}"
        if not self.divides_the_ranks(size, said, "expert-parallel") or size == 1:
            return
        if self.get("tensor_parallel.autotp_size", 0) not in (0, 1):
            self.problems.append(f"{said}: DeepSpeed's AutoTP (tensor_parallel.autotp_size) does not run beside"
                                 " expert parallelism here yet; choose one of the two")
        elif self.sequence_parallel_size > 1:
            self.problems.append(f"{said}: DeepSpeed's sequence parallelism (sequence_parallel_size) does not run"
                                 " beside expert parallelism here yet; choose one of the two")
        elif self.get("zero_optimization.stage", 0) in (1, 2) and "optimizer" not in self.config:
            # Measured on 0.19.8: "The model has moe layers, but None of the param groups are marked as MoE".
            stage = self.get("zero_optimization.stage")
            self.problems.append(f"{said}: DeepSpeed's ZeRO-{stage} steps AutoEP's experts only in parameter groups"
                                 " of their own, which the optimizer of configure_optimizers, built before AutoEP"
                                 " makes the experts, cannot have; use ZeRO-3 (strategy=deepspeed_stage_3), or an"
                                 " optimizer block in the DeepSpeed config (strategy.config), from which DeepSpeed"
                                 " builds them")

    def report_unfillable_autos(self) -> None:
        for key in auto_keys(self.config):
            if key not in self.deferred | self.unfillable:
                self.problems.append(f'{key}="auto" is not a value we fill; "auto" works for: {", ".join(FILLED_KEYS)}')


    def validate_zero_section(self) -> None:
        """DeepSpeed's own validation of `zero_optimization`, run here so its refusals come before launch, by key."""
        zero = self.config.get("zero_optimization")
        if not isinstance(zero, dict) or auto_keys(zero):
            return
        import deepspeed
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
        from pydantic import ValidationError

        try:
            DeepSpeedZeroConfig(**zero)
        except ValidationError as error:
            for detail in error.errors():
                key = ".".join(["zero_optimization", *map(str, detail["loc"])])
                self.problems.append(
                    f"{key}={_show(detail.get('input'))}: DeepSpeed {deepspeed.__version__} refuses it "
                    f"({detail['msg']})"
                )


def _copied_from(optimizer: Any, name: str) -> tuple[Any, str | None]:
    """(value, why it cannot be filled) for an optimizer setting copied from `configure_optimizers`."""
    if optimizer is UNKNOWN:
        return UNKNOWN, None
    if optimizer is None:
        return None, "LightningModule.configure_optimizers returns no optimizer to copy it from"
    value = getattr(optimizer, name)
    if value is None:
        return None, f"configure_optimizers returns {optimizer.name}, which has no {name}"
    return (list(value) if isinstance(value, tuple) else value), None


def auto_keys(node: Any, prefix: str = "") -> list[str]:
    """The dotted keys whose value is "auto" in a DeepSpeed config (or a part of one)."""
    if isinstance(node, dict):
        return [key for name, value in node.items() for key in auto_keys(value, f"{prefix}{name}.")]
    return [prefix.rstrip(".")] if node == AUTO else []
