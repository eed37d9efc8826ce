"""The runs that train nothing: `plan=true` (the memory plan of this run and of every preset) and `dry_run=true` (the
strategy's set-up and two steps at the configured world size, on fake tensors, beside the plan)."""

from __future__ import annotations

import sys

from omegaconf import DictConfig, OmegaConf

from lightning_dist._compat.fake_cuda import FakeCudaRunFailed
from lightning_dist.dry_run import RankView, dry_run_configured, dry_run_devices, dry_run_refusal
from lightning_dist.dry_run import table as dry_run_table
from lightning_dist.memory import MemoryPlan, layout_of, plan_memory
from lightning_dist.parallel.device_check import DeviceMismatch
from lightning_dist.run.compose import CONFIG_MISTAKES, Composed, compose, config_error, device_count, module_config
from lightning_dist.run.config_check import ConfigError
from lightning_dist.run.preset_table import compare_presets


def plan(cfg: DictConfig) -> MemoryPlan:
    """`plan=true`: print the memory plan of this run and of every preset, and train nothing."""
    try:
        composed = compose(cfg)
        devices, num_nodes = device_count(cfg)
        facts = composed.facts()
        layout = layout_of(composed.strategy, composed.strategy_name)
        memory_plan = plan_memory(facts, layout, cfg.trainer.precision, devices=devices, num_nodes=num_nodes)
    except CONFIG_MISTAKES as error:
        raise config_error(error) from error
    print(memory_plan.table())
    print()
    print(compare_presets(facts, cfg.trainer.precision, devices, num_nodes, model=composed.model_on_meta()))
    return memory_plan


def refuse_what_a_dry_run_cannot_follow(composed: Composed) -> None:
    """ConfigError in one line where the dry run cannot run this strategy or model."""
    if refusal := dry_run_refusal(composed.strategy):
        raise ConfigError(f"dry_run=true: strategy={composed.strategy_name}: {refusal}; plan=true gives its memory")
    if (size := getattr(composed.strategy, "autoep_size", 1)) > 1:  # DeepSpeed's expert parallelism
        raise ConfigError(f"dry_run=true: strategy.expert_parallel_size={size}: DeepSpeed's AutoEP is not dry-run yet"
                          " (FSDP's expert parallelism is: strategy=fsdp); plan=true gives its memory")


def dry_run(cfg: DictConfig) -> list[RankView]:
    """`dry_run=true`: the strategy's set-up and two steps at the configured world size, seen from the first and the
    last rank (or `dry_run_ranks`), under a fake process group and fake tensors; printed beside the plan."""
    try:
        composed = compose(cfg, choose=False)  # the strategy travels as its config (below): auto_fit's is not one
        name = composed.strategy_name
        refuse_what_a_dry_run_cannot_follow(composed)
        devices, num_nodes = device_count(cfg)
        world = devices * num_nodes
        ranks = tuple(cfg.get("dry_run_ranks") or (0, world - 1))
        if any(not 0 <= rank < world for rank in ranks):
            raise ConfigError(f"dry_run_ranks={list(ranks)}: global ranks of this run are 0 to {world - 1}")
        facts = composed.facts()
        batch = next(iter(composed.datamodule.train_dataloader()))
        ranks = tuple(dict.fromkeys(ranks))  # each once, in the order given
        memory_plan = plan_memory(facts, layout_of(composed.strategy, name), cfg.trainer.precision, devices=devices,
                                  num_nodes=num_nodes)
        configs = (OmegaConf.to_container(cfg.strategy, resolve=True), OmegaConf.to_container(module_config(cfg)))
    except CONFIG_MISTAKES as error:
        raise config_error(error) from error
    device_type, run, where = dry_run_devices(cfg.trainer.accelerator, devices)
    try:
        views = run(dry_run_configured, *configs, batch, cfg.trainer.precision, devices, num_nodes, ranks, device_type)
    except (DeviceMismatch, FakeCudaRunFailed) as failure:
        if isinstance(failure, FakeCudaRunFailed) and not str(failure).startswith(DeviceMismatch.__name__):
            print(failure.child_traceback, file=sys.stderr)  # where it failed, in the process with CUDA faked
            raise
        raise ConfigError(f"dry_run=true found a device mismatch: {str(failure).removeprefix('DeviceMismatch: ')}")
    print(dry_run_table(views, name, cfg.trainer.precision, devices, num_nodes, memory_plan.device, where,
                        planned_host=memory_plan.host_total / devices,
                        device_memory_gb=cfg.get("dry_run_device_memory_gb", 80),
                        planned_nvme=sum(memory_plan.nvme.values()) / devices))
    return views
