"""The patches lightning_dist/_compat/deepspeed.py applies, each doing what it says (the fence test checks only that
the symbols they patch still exist)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import cpuinfo
import pytest

from lightning_dist._compat.deepspeed import CPU_INFO_ENV, remember_cpu_info

pytestmark = pytest.mark.compat  # also run on the oldest and the newest torch (.ci/compat_tier)

FAKE_CPU = {"arch": "X86_64", "flags": ["avx2", "fma"], "brand_raw": "a CPU no machine has"}


def test_the_cpu_is_described_once_per_job_and_handed_to_the_ranks_it_starts(monkeypatch):
    asked = []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: asked.append(1) or dict(FAKE_CPU))
    monkeypatch.delenv(CPU_INFO_ENV, raising=False)
    remember_cpu_info()
    remember_cpu_info()  # once per process, however many callers install it

    from deepspeed.ops.op_builder.cpu import CPUAdamBuilder

    # The op's compile flags, which decide whether the cached build is reused, from one question to py-cpuinfo.
    flags = CPUAdamBuilder().cxx_args()
    assert "-march=native" in flags and "-D__AVX256__" in flags
    CPUAdamBuilder().cxx_args()
    assert asked == [1]
    assert json.loads(os.environ[CPU_INFO_ENV])["info"] == FAKE_CPU

    # A rank started from here on the same host asks nothing: it reads the fake answer, not its real CPU's.
    code = ("import json, cpuinfo\nfrom lightning_dist._compat.deepspeed import remember_cpu_info\n"
            "remember_cpu_info()\nprint(json.dumps(cpuinfo.get_cpu_info()))")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    assert json.loads(child.stdout.splitlines()[-1]) == FAKE_CPU


def test_an_answer_from_another_host_is_not_used(monkeypatch):
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: dict(FAKE_CPU))
    monkeypatch.setenv(CPU_INFO_ENV, json.dumps({"host": "another-node", "info": {"arch": "ARM_8", "flags": []}}))
    remember_cpu_info()
    assert cpuinfo.get_cpu_info() == FAKE_CPU
    assert json.loads(os.environ[CPU_INFO_ENV])["host"] != "another-node"
