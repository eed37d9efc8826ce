from lightning_dist.callbacks.host_syncs import HostSyncs
from lightning_dist.callbacks.model_checkpoint import ModelCheckpoint
from lightning_dist.callbacks.preemption import PREEMPTED_EXIT_CODE, Preempted, Preemption
from lightning_dist.callbacks.progress import StepProgressBar
from lightning_dist.callbacks.run_summary import RunSummary
from lightning_dist.callbacks.training_monitor import NonFiniteError, TrainingMonitor
from lightning_dist.callbacks.validate_at_max_steps import ValidateAtMaxSteps

__all__ = [
    "HostSyncs",
    "ModelCheckpoint",
    "NonFiniteError",
    "PREEMPTED_EXIT_CODE",
    "Preempted",
    "Preemption",
    "RunSummary",
    "StepProgressBar",
    "TrainingMonitor",
    "ValidateAtMaxSteps",
]
