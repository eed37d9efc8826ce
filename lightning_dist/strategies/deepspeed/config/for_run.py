"""A DeepSpeed strategy's config, as one run sees it: the file or the preset's options (`RunConfig`), resolved with
what the Trainer, the module and the data say; a preset's buffers sized by the model."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_dist.strategies.deepspeed.config.facts import training_facts
from lightning_dist.strategies.deepspeed.config.gathering import gathering_sized_by_model
from lightning_dist.strategies.deepspeed.config.load import load_user_config, write_effective_config
from lightning_dist.strategies.deepspeed.config.outputs import anchor_output_paths
from lightning_dist.strategies.deepspeed.config.resolve import Resolution, ZeroOptions, buckets_sized_by_model, resolve
from lightning_dist.strategies.deepspeed.config.swap_buffers import swap_buffers_sized_by_model
from lightning_dist.strategies.deepspeed.config.zero import Offload, ZeroSection, option_problems

PRESET = "strategy"  # the source of a config built from the strategy's options rather than read from a file


@dataclass
class RunConfig:
    """The strategy's options (`zero_options`, each None when not asked for) and the user's file (`user_config`,
    None for a preset), with where the file came from (`source`, for messages)."""

    zero_options: ZeroOptions = field(default_factory=ZeroOptions)
    user_config: dict[str, Any] | None = None
    source: str = PRESET

    @classmethod
    def of(cls, stage: int | None, offload_optimizer: str | None, offload_parameters: str | None,
           nvme_path: str | Path | None, config: str | Path | dict[str, Any] | None,
           tensor_parallel_size: int | None = None, context_parallel_size: int | None = None,
           expert_parallel_size: int | None = None) -> RunConfig:
        """Raises ValueError naming the first option that cannot be (before any rank starts)."""
        nvme = str(nvme_path) if nvme_path else None
        problems = option_problems(stage, offload_optimizer, offload_parameters, nvme, with_config=config is not None)
        if problems:
            raise ValueError(problems[0])
        size = tensor_parallel_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1)):
            raise ValueError(f"strategy.tensor_parallel_size={size!r}: give a whole number of ranks, at least 1, or -1"
                             " (every rank)")
        cp = context_parallel_size
        if cp is not None and (isinstance(cp, bool) or not isinstance(cp, int) or cp < 1):
            raise ValueError(f"strategy.context_parallel_size={cp!r}: give a whole number of ranks, at least 1")
        ep = expert_parallel_size
        if ep is not None and (isinstance(ep, bool) or not isinstance(ep, int) or ep < 1):
            raise ValueError(f"strategy.expert_parallel_size={ep!r}: give a whole number of ranks, at least 1")
        if config is None:  # the ZeRO options become Lightning's config; the parallel sizes are merged into it
            return cls(ZeroOptions(tensor_parallel_size=size, context_parallel_size=cp, expert_parallel_size=ep))
        user_config, source = load_user_config(config)
        # The options are merged into the file when the run starts, where conflicts are reported with the rest.
        return cls(ZeroOptions(stage, offload_optimizer, offload_parameters, nvme, size, cp, ep), user_config, source)

    @property
    def is_preset(self) -> bool:
        return self.source == PRESET

    def zero(self, base_config: dict[str, Any]) -> ZeroSection:
        """The ZeRO section in effect: the options over the file's (or the preset's) section."""
        section = ZeroSection.of(base_config)
        options = self.zero_options
        return ZeroSection(
            options.stage if options.stage is not None else section.stage,
            section.optimizer if options.offload_optimizer is None else Offload(options.offload_optimizer),
            section.parameters if options.offload_parameters is None else Offload(options.offload_parameters),
        )

    def resolve(self, base_config: dict[str, Any], world_size: int, trainer: Any, model: Any, loader: Any = None,
                datamodule: Any = None, in_rank: bool = True) -> Resolution:
        needs_optimizer = "optimizer" in base_config or "scheduler" in base_config
        facts = training_facts(trainer, model, loader, datamodule, need_optimizer=needs_optimizer, in_rank=in_rank)
        config = base_config
        if self.is_preset and facts.hidden_size:  # a preset: no file chose the bucket sizes
            config = buckets_sized_by_model(config)
        resolution = resolve(config, facts, self.zero_options, self.source)
        if self.is_preset and model is not None:  # nor how much is gathered, nor the NVMe pool
            config = gathering_sized_by_model(resolution.config, model)
            resolution.config = swap_buffers_sized_by_model(config, model.modules(), world_size)
        return resolution


def config_in_effect(resolution: Resolution, run_dir: str | Path | None, write: bool) -> dict[str, Any]:
    """The resolved config as the engine gets it: output paths under the run's directory (the working directory for
    a run without one), its notes said, and (`write`: on one rank) written beside the run."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    for note in resolution.notes:
        rank_zero_info(note)
    config = anchor_output_paths(resolution.config, run_dir if run_dir is not None else Path.cwd())
    # Without an optimizer block the optimizer comes from configure_optimizers, and ZeRO refuses the ones it has not
    # tested; Lightning's test/predict path under ZeRO-3 reads this key whether or not there is a block.
    config.setdefault("zero_allow_untested_optimizer", True)
    if write and run_dir is not None:
        rank_zero_info(f"DeepSpeed config in effect: {write_effective_config(config, run_dir)}")
    return config
