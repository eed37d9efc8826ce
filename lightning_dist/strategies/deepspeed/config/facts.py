"""What the Trainer, the LightningModule and the data say about a run: the values a DeepSpeed "auto" stands for.

Facts are gathered twice: on the launching process before any rank is spawned (some may still be UNKNOWN there,
e.g. a loader that only exists after `setup`), and on every rank in `setup`, where all of them are known.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning.pytorch.trainer.states import TrainerFn

from lightning_dist.memory.hidden_size import hidden_size_of
from lightning_dist.parallel.precision import fp16_supported

UNKNOWN: Any = type("Unknown", (), {"__repr__": lambda self: "UNKNOWN"})()


@dataclass(frozen=True)
class OptimizerFacts:
    name: str
    lr: float
    betas: tuple[float, float] | None
    eps: float | None
    weight_decay: float


@dataclass(frozen=True)
class TrainingFacts:
    precision: str
    world_size: int
    accumulate_grad_batches: int
    gradient_clip_val: float | None
    gradient_clip_algorithm: str | None
    fp16_supported: bool
    device_type: str
    micro_batch_size: int | None = UNKNOWN
    optimizer: OptimizerFacts | None = UNKNOWN  # from configure_optimizers; None: it returns no optimizer
    warmup_steps: int = 0
    total_steps: int | None = UNKNOWN
    hidden_size: int | None = None
    manual_optimization: bool = False  # the module steps its optimizer itself (`automatic_optimization = False`)


def training_facts(
    trainer: Any,
    model: Any = None,
    train_dataloader: Any = None,
    datamodule: Any = None,
    need_optimizer: bool = False,
    in_rank: bool = False,
) -> TrainingFacts:
    """Collect the facts; `in_rank` (inside `setup`) may ask the fit loop for the real train loader."""
    strategy = trainer.strategy
    device_type = strategy.root_device.type
    hparams = getattr(model, "hparams", {}) or {}
    return TrainingFacts(
        precision=str(trainer.precision),
        world_size=strategy.num_nodes * strategy.num_processes,
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        gradient_clip_val=trainer.gradient_clip_val,
        gradient_clip_algorithm=str(
            trainer.gradient_clip_algorithm.value if trainer.gradient_clip_algorithm else "norm"
        ),
        fp16_supported=fp16_supported(device_type),
        device_type=device_type,
        micro_batch_size=_micro_batch_size(trainer, train_dataloader, datamodule, in_rank),
        optimizer=module_optimizer_facts(model, trainer, in_rank) if need_optimizer else UNKNOWN,
        warmup_steps=int(hparams.get("warmup_steps", 0) or 0),
        total_steps=_total_steps(trainer, in_rank),
        hidden_size=hidden_size_of(model),
        manual_optimization=model is not None and not getattr(model, "automatic_optimization", True),
    )


def _micro_batch_size(trainer: Any, train_dataloader: Any, datamodule: Any, in_rank: bool) -> int | None:
    loader = train_dataloader
    if loader is None and in_rank:
        from lightning_dist._compat.lightning import train_data_source

        source = train_data_source(trainer)
        loader = source.dataloader() if source.is_defined() else None
    if loader is not None:
        sampler = getattr(loader, "batch_sampler", None)
        return getattr(sampler, "batch_size", None) or getattr(loader, "batch_size", None) or UNKNOWN
    # Before `setup` a datamodule has no loader yet; the conventional attribute says what it will be.
    for source in (datamodule, getattr(datamodule, "hparams", None)):
        size = getattr(source, "batch_size", None) if source is not None else None
        if isinstance(size, int):
            return size
    return UNKNOWN


def module_optimizer_facts(model: Any, trainer: Any, in_rank: bool) -> OptimizerFacts | None:
    """The hyper-parameters of the optimizer that `configure_optimizers` builds (the first group's, which by
    convention is the one with weight decay)."""
    from lightning_dist._compat.lightning import module_optimizers

    if model is None:
        return UNKNOWN
    try:
        optimizers = module_optimizers(model)
    except Exception:
        # Some modules need the fitting Trainer (e.g. estimated_stepping_batches); the in-rank pass will know.
        if in_rank:
            raise
        return UNKNOWN
    if not optimizers:
        return None
    optimizer = optimizers[0]
    group = optimizer.param_groups[0]
    return OptimizerFacts(
        name=type(optimizer).__name__,
        lr=float(group["lr"]),
        betas=tuple(group["betas"]) if "betas" in group else None,
        eps=float(group["eps"]) if "eps" in group else None,
        weight_decay=float(group.get("weight_decay", 0.0)),
    )


def _total_steps(trainer: Any, in_rank: bool) -> int | None:
    if trainer.max_steps and trainer.max_steps > 0:
        return int(trainer.max_steps)
    # Epoch-limited: only the fitting Trainer, with its train loader, can count the steps.
    fitting = in_rank and trainer.state.fn == TrainerFn.FITTING
    return int(trainer.estimated_stepping_batches) if fitting else UNKNOWN
