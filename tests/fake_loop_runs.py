"""Runs of Lightning's whole loop on fake CUDA devices (lightning_dist/dry_run/fake_loop.py) for tests/test_loop_on_cuda.py:
every preset in one process with CUDA faked, and the same with one of the fixes for state left on the host undone."""

from __future__ import annotations

import traceback
from contextlib import ExitStack
from unittest import mock

from lightning_dist.dry_run.fake_loop import LoopReport, loop_on_fake_devices

# Each fix for module state that an engine leaves on the host, as the strategies call it, and what undoes it here.
UNDONE = {
    # ZeRO-3 placed only the parameters of a model built without weights: buffers and metric states moved after.
    "deepspeed_metric_states": ("lightning_dist.strategies.deepspeed.strategy.move_module_state", lambda module, device: []),
    # FSDP's CPU offload keeps the module on the host for its shards: buffers and metric states moved after.
    "fsdp_offload_metric_states": ("lightning_dist.strategies.torch.fsdp.move_module_state", lambda module, device: []),
    # test after fit: fit's teardown moved ZeRO-3's module to the host; init_deepspeed puts it back.
    "deepspeed_test_after_fit": ("lightning_dist.strategies.deepspeed.strategy.zero3_partitions", lambda module: []),
}


def loops_each(runs: dict[str, tuple], undone: str | None = None) -> dict[str, LoopReport | str]:
    """Each named loop (`loop_on_fake_devices`' arguments), in this one process, with the fix `undone` undone:
    its report, or the error it ended with (`Type: message`). Each as its own job would run it: ZeRO-3 replaces
    torch's linear for the process (parallel/zero3_runtime.py), which is put back after each."""
    import torch.nn.functional as F

    reports: dict[str, LoopReport | str] = {}
    for name, arguments in runs.items():
        with ExitStack() as stack:
            stack.enter_context(mock.patch.object(F, "linear", F.linear))
            if undone is not None:
                target, replacement = UNDONE[undone]
                stack.enter_context(mock.patch(target, replacement))
            try:
                reports[name] = loop_on_fake_devices(*arguments)
            except Exception as error:  # noqa: BLE001 - reported to the test, which names the preset
                reports[name] = f"{type(error).__name__}: {error}\n{traceback.format_exc()[-3000:]}"
    return reports
