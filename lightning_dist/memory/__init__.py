"""Know before you launch: what a run will hold per device and per node, and the strategy that fits."""

from lightning_dist.memory.auto_fit import AutoFit, Choice, NothingFits
from lightning_dist.memory.layout import Layout, layout_of
from lightning_dist.memory.measure import model_state_bytes
from lightning_dist.memory.model_facts import ModelFacts
from lightning_dist.memory.planner import GB, MemoryPlan, plan_memory

__all__ = [
    "GB",
    "AutoFit",
    "Choice",
    "Layout",
    "MemoryPlan",
    "ModelFacts",
    "NothingFits",
    "layout_of",
    "model_state_bytes",
    "plan_memory",
]
