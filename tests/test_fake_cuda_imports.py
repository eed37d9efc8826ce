"""With CUDA faked, a library that picks its backend from torch.cuda as it is imported (bitsandbytes, which PEFT
imports) is imported as this machine is, whenever a call imports it: not up front, which cost every dry run about 3 s
of torch's inductor, and not on the fake devices, where it bound the CUDA build's stream API and a LoRA run's dry run
stopped (the run itself: tests/memory/test_routed_experts.py, "hf_mixtral lora deepspeed_stage_3")."""

from __future__ import annotations

from lightning_dist._compat import fake_cuda


def bitsandbytes_as_imported() -> tuple:
    import sys

    import torch

    imported_before = "bitsandbytes" in sys.modules
    import bitsandbytes  # noqa: F401

    return (imported_before, "bitsandbytes.backends.cuda.ops" in sys.modules, torch.cuda.is_available(),
            torch.cuda.device_count())


def test_bitsandbytes_is_imported_when_called_for_without_the_fake_devices_which_stay():
    # Not imported before the call; imported without its CUDA backend; the 4 fake devices there before and after.
    assert fake_cuda.run_with_fake_cuda(bitsandbytes_as_imported, devices=4) == (False, False, True, 4)
