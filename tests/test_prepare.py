"""No silent minutes: before DeepSpeed compiles a native op, one line says which, what for, that it happens once and
where it is cached; `python -m lightning_dist.prepare` builds them ahead of time."""

from __future__ import annotations

import subprocess
import sys

import pytest
from deepspeed.accelerator import get_accelerator

from lightning_dist._compat.deepspeed import op_build_directory, op_is_built
from lightning_dist.lifecycle.op_build_lock import announce_op_builds
from tests.conftest import REPO, documented, run_documented


class BuildStarted(Exception):
    """Stands for the compile itself (minutes): the test is about what is said before it."""


def test_a_first_build_is_announced_in_one_line_and_a_cached_op_is_not(tmp_path, monkeypatch):
    import torch.utils.cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # an empty cache: cpu_adam was never built here
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kwargs: (_ for _ in ()).throw(BuildStarted()))
    from deepspeed.ops.op_builder.builder import OpBuilder

    # DeepSpeed's own, unwrapped if an earlier test in this process announced builds; restored afterwards.
    monkeypatch.setattr(OpBuilder, "jit_load", getattr(OpBuilder.jit_load, "__wrapped__", OpBuilder.jit_load))
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})  # as in a process that has loaded no op yet (the suite's has)
    said: list[str] = []
    announce_op_builds(said.append)
    builder = get_accelerator().create_op_builder("CPUAdamBuilder")
    with pytest.raises(BuildStarted):
        builder.jit_load(verbose=False)
    assert said == [f"DeepSpeed is compiling its cpu_adam op for optimizer offload (DeepSpeed's CPU Adam): once per"
                    f" machine (a few minutes), cached in {tmp_path}/cpu_adam; `python -m lightning_dist.prepare`"
                    " does it ahead of time"]
    (op_build_directory("cpu_adam") / "cpu_adam.so").write_bytes(b"")  # as a finished build leaves it
    assert op_is_built("cpu_adam")
    with pytest.raises(BuildStarted):  # torch decides whether to rebuild; nothing is said for a cached op
        builder.jit_load(verbose=False)
    assert len(said) == 1


# Cold: what a fresh interpreter prints first. DeepSpeed's line that it fell back to the CPU came before ours there,
# never in a process forked from the warm one (which had picked its accelerator already).
@pytest.mark.cold
def test_prepare_builds_or_finds_each_op_and_names_an_unknown_one(deepspeed_ops, tmp_path):
    documented_command = documented(REPO / "docs" / "install.md", "python -m lightning_dist.prepare")
    done = run_documented(documented_command, tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("cpu_adam: ready in ") and str(op_build_directory("cpu_adam")) in done.stdout
    unknown = subprocess.run([sys.executable, "-m", "lightning_dist.prepare", "fused_adam"], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert unknown.returncode == 2
    assert unknown.stderr.splitlines()[-1].endswith("error: fused_adam: no such op; choose from cpu_adam, async_io")
