"""DeepSpeed's Muon module is imported with its `torch.compile` calls deferred: the same classes, no compiler stack
imported at start-up, and a function still compiled (once) when it is first called."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from lightning_dist.strategies.deepspeed import deferred_compile
from tests.conftest import REPO


def test_compile_is_deferred_to_the_first_call_and_done_once(monkeypatch):
    compiled = []

    def fake_compile(function, **options):
        compiled.append(options)
        return lambda *args: function(*args) * 10

    monkeypatch.setattr(torch, "compile", fake_compile)

    @deferred_compile.compile_on_first_call(dynamic=False)
    def double(x):
        return 2 * x

    assert compiled == [] and double.__name__ == "double"
    assert double(3) == 60 and double(4) == 80
    assert compiled == [{"dynamic": False}]


@pytest.mark.cold  # what a fresh process imports
def test_muon_module_imports_without_the_compiler_stack():
    probe = (
        "import sys, lightning, deepspeed\n"
        "from lightning_dist.strategies.deepspeed.deferred_compile import import_muon_with_deferred_compilation\n"
        "import_muon_with_deferred_compilation(); import_muon_with_deferred_compilation()\n"
        "from deepspeed.runtime import compiler\n"
        "from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam\n"
        "from deepspeed.runtime.zero.muon import original_muon\n"
        "print(MuonWithAuxAdam.__module__, 'torch._dynamo.repro.after_dynamo' in sys.modules, 'networkx' in sys.modules,\n"
        "      compiler.compile() is __import__('torch').compile, original_muon.zeropower_via_newtonschulz5.__name__)\n"
    )
    env = {"PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    # Without the deferral both are imported (torch.compile's debug backends; functorch's partitioners need networkx).
    # DeepSpeed's compile() is restored afterwards; the compiled function keeps its name.
    assert done.stdout.split() == ["deepspeed.runtime.zero.muon.muon_optimizer", "False", "False", "True",
                                   "zeropower_via_newtonschulz5"]
