"""What a strategy refuses from its options alone, said the same wherever it is found: by the strategy before it
launches (a Trainer built in Python), and by the command line from the composed config before anything loads torch
(lightning_dist/run/config_values.py), in one line in well under a second. No torch here."""

from __future__ import annotations

DEEPSPEED_ASYNC_CHECKPOINT = (
    "checkpoint.async=true: DeepSpeed's engine writes its checkpoints itself, synchronously, and has no hook to stage"
    " them; its own asynchronous writer is a ds_config setting (checkpoint.writer.decoupled, FastPersist on the"
    " async_io op). Background saves are for the ddp and fsdp presets"
)
# Op-level checkpointing replays a block's ops in backward and must meet the same ones; ZeRO-3 gathers and frees
# the block's parameters inside it, at other points when recomputing (measured: "aten.empty ... encountered during
# backward but not found in storage").
OPS_UNDER_ZERO_3 = (
    "strategy.activation_checkpointing=ops: ZeRO-3 gathers and frees parameters inside each block, which op-level"
    " checkpointing cannot replay; use true (every block) or an integer k (every k-th block)"
)


def frozen_left_out_refusal(exclude_frozen_parameters: bool, **sizes: object) -> str | None:
    """Why checkpoints cannot leave the frozen weights out beside these parallel sizes (`tensor_parallel_size=2`),
    or None: where a rank holds only part of the model in weights of its own (DeepSpeed's AutoTP and AutoEP, FSDP's
    pipeline stages and expert parallelism), the parts a resume takes from the model could not all be checked whole
    (checkpoints/frozen_weights.py)."""
    split = [f"strategy.{name}={size}" for name, size in sizes.items()
             if isinstance(size, int) and not isinstance(size, bool) and size > 1]
    if not exclude_frozen_parameters or not split:
        return None
    return (f"strategy.exclude_frozen_parameters=true with {split[0]}: each rank holds part of the model there, and"
            " a resume could not check the frozen parts it takes from the model; save them (false), or train without"
            " that split")


def deepspeed_refusal(stage: object, op_level_checkpointing: bool, async_checkpoint: bool) -> str | None:
    """Why DeepSpeed cannot run these options, or None. `stage`: the ZeRO stage, where known."""
    if async_checkpoint:
        return DEEPSPEED_ASYNC_CHECKPOINT
    if op_level_checkpointing and str(stage) == "3":
        return OPS_UNDER_ZERO_3
    return None
