"""No silent minutes: before DeepSpeed compiles a native op, one line says which, what for, where it is cached and how
long its last build on this machine took; a load still waiting after 5 s names the process it waits on; each venv
keeps its own op cache; `lightning-dist prepare` builds the ops ahead of time, those a preset needs or those named."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from deepspeed.accelerator import get_accelerator

from lightning_dist._compat.deepspeed import op_build_directory, op_is_built
from lightning_dist.lifecycle import op_builds
from lightning_dist.lifecycle.op_builds import announce_op_builds
from lightning_dist.strategies.presets import PRESETS
from tests import warm_python
from tests.conftest import REPO, documented, run_documented


class BuildStarted(Exception):
    """Stands for the compile itself (minutes): the test is about what is said before it."""


def test_a_first_build_is_announced_in_one_line_and_a_cached_op_is_not(tmp_path, monkeypatch):
    import torch.utils.cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # an empty cache: cpu_adam was never built here
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home_cache"))  # no build of it remembered on this machine
    monkeypatch.setattr(op_builds, "FIRST_NOTICE_S", 600.0)  # DeepSpeed's checks before the compile took 5 s here
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
    line = ("DeepSpeed is compiling its cpu_adam op for optimizer offload (DeepSpeed's CPU Adam): once per environment"
            " ({took}), cached in {tmp_path}/cpu_adam; `lightning-dist prepare` does it ahead of time")
    assert said == [line.format(took="a few minutes", tmp_path=tmp_path)]
    (tmp_path / "home_cache" / "lightning_dist").mkdir(parents=True)  # as a finished build here leaves it
    (tmp_path / "home_cache" / "lightning_dist" / "op_build_seconds.json").write_text('{"cpu_adam": 53.4}')
    with pytest.raises(BuildStarted):
        builder.jit_load(verbose=False)
    assert said[1:] == [line.format(took="53 s the last time on this machine", tmp_path=tmp_path)]
    (op_build_directory("cpu_adam") / "cpu_adam.so").write_bytes(b"")  # as a finished build leaves it
    assert op_is_built("cpu_adam")
    with pytest.raises(BuildStarted):  # torch decides whether to rebuild; nothing is said for a cached op
        builder.jit_load(verbose=False)
    assert len(said) == 2


def test_each_venv_compiles_into_its_own_op_cache_unless_one_is_set(tmp_path):
    """Two venvs on one machine: each one's ops in its own directory, so neither rebuilds the other's (their build
    files name their own include paths) nor waits on its lock; TORCH_EXTENSIONS_DIR, where set, is kept."""
    where = ("from lightning_dist.lifecycle.op_builds import keep_op_cache_in_this_environment as keep;"
             " from lightning_dist._compat.deepspeed import op_build_directory; keep(); print(op_build_directory('cpu_adam'))")
    env = {name: value for name, value in os.environ.items() if name != "TORCH_EXTENSIONS_DIR"} | {"PYTHONPATH": str(REPO)}
    directories = []
    for name in ("first", "second"):
        venv = tmp_path / name
        subprocess.run([warm_python.REAL_PYTHON, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                       check=True)
        (site,) = venv.glob("lib/python*/site-packages")  # this suite's libraries, as in tests/test_installed_package.py
        (site / "suite.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        done = subprocess.run([str(venv / "bin" / "python"), "-c", where], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        directories.append(Path(done.stdout.strip().splitlines()[-1]))
        assert directories[-1] == venv / "torch_extensions" / "cpu_adam"
    set_here = subprocess.run([sys.executable, "-c", where], env=env | {"TORCH_EXTENSIONS_DIR": str(tmp_path / "mine")},
                              capture_output=True, text=True, timeout=120)
    assert Path(set_here.stdout.strip().splitlines()[-1]) == tmp_path / "mine" / "cpu_adam"


@pytest.mark.slow
def test_a_load_waiting_on_another_process_build_says_so_within_5_s(tmp_path, deepspeed_ops):
    """The op as this suite built it, its build lock held by another process for 12 s (as a build or a check in
    another run holds it): the load waits, says on whom after 5 s, and loads once the lock is released."""
    extensions = tmp_path / "extensions"
    shutil.copytree(op_build_directory("cpu_adam"), extensions / "cpu_adam", ignore=shutil.ignore_patterns("lock"))
    lock = extensions / "cpu_adam" / "lock"
    # Held both ways torch waits: the file's existence (through 2.13) and an advisory lock on it (2.14 on).
    holder = subprocess.Popen([warm_python.REAL_PYTHON, "-c", "import fcntl, os, sys, time; held = open(sys.argv[1], 'w');"
                               " fcntl.flock(held, fcntl.LOCK_EX); print(flush=True); time.sleep(12); os.unlink(sys.argv[1])",
                               str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        holder.stdout.readline()
        process = subprocess.run([sys.executable, "-m", "lightning_dist.prepare", "cpu_adam"], cwd=REPO,
                                 env={**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions)}, capture_output=True,
                                 text=True, timeout=300)
    finally:
        holder.kill()
        holder.wait()
    assert process.returncode == 0, process.stderr[-3000:]
    lines = process.stdout.splitlines()
    assert f"still loading DeepSpeed's cpu_adam op after 5 s: waiting on process {holder.pid}, which holds its build" \
           f" lock in {extensions / 'cpu_adam'} (it compiles or checks the op)" in lines
    assert lines[-1].startswith("cpu_adam: ready in ")
    assert float(lines[-1].split()[3]) >= 10  # it did wait for the lock


# Cold: what a fresh interpreter prints first. DeepSpeed's line that it fell back to the CPU came before ours there,
# never in a process forked from the warm one (which had picked its accelerator already).
@pytest.mark.cold
def test_prepare_builds_or_finds_what_a_preset_needs_and_names_an_unknown_one(deepspeed_ops, tmp_path):
    documented_command = documented(REPO / "docs" / "install.md", "python -m lightning_dist.prepare")
    done = run_documented(documented_command, tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "deepspeed_stage_3_offload: cpu_adam"  # not async_io: nothing of it goes to NVMe
    assert lines[1].startswith("cpu_adam: ready in ") and str(op_build_directory("cpu_adam")) in lines[1]
    assert len(lines) == 2
    unknown = subprocess.run([sys.executable, "-m", "lightning_dist.prepare", "fused_adam"], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert unknown.returncode == 2
    assert unknown.stderr.splitlines()[-1].endswith(
        f"error: fused_adam: no such op or preset; choose an op (cpu_adam, async_io) or a preset ({', '.join(PRESETS)})")


def test_ops_build_with_the_ninja_beside_this_python_whatever_path_finds_first(tmp_path):
    """ninja 1.11 (a system's) and 1.13 (PyPI's, in the venv) each read the other's build log as out of date ("build
    log version is too old; starting over") and compile the op again: an op prepared with one, then loaded by a run
    whose PATH found the other, was compiled twice (CI's compatibility tier: cpu_adam again at test time, 2-3 minutes
    a torch). A load under our strategies, or `prepare`, runs the ninja of this Python's environment."""
    other = tmp_path / "system_bin"
    other.mkdir()
    (other / "ninja").write_text("#!/bin/sh\necho 1.11.1\n")
    (other / "ninja").chmod(0o755)
    code = ("import shutil; from lightning_dist.lifecycle.op_builds import announce_op_builds;"
            " print(shutil.which('ninja')); announce_op_builds(print); announce_op_builds(print);"
            " import os; print(shutil.which('ninja'), os.environ['PATH'].count(os.pathsep))")
    own = Path(warm_python.REAL_PYTHON).parent / "ninja"
    assert own.is_file()  # the `ninja` package, which DeepSpeed requires
    done = subprocess.run([warm_python.REAL_PYTHON, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DS_ACCELERATOR": "cpu",
                               "PATH": f"{other}{os.pathsep}/usr/bin{os.pathsep}/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    before, after = [line for line in done.stdout.splitlines() if "ninja" in line]
    assert before == str(other / "ninja")
    assert after == f"{own} 3"  # first on PATH, once


def test_the_environments_ninja_is_found_where_a_launcher_replaced_sys_executable(tmp_path, monkeypatch):
    """The suite's own case: its warm Python's launcher, in a temporary directory, is `sys.executable`. Looked for
    beside it, the venv's ninja was not found and the compatibility tier's first test compiled cpu_adam again with
    the system's ninja (174 s)."""
    other = tmp_path / "system_bin"
    other.mkdir()
    (other / "ninja").write_text("#!/bin/sh\necho 1.11.1\n")
    (other / "ninja").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "launcher" / "python"))
    monkeypatch.setenv("PATH", f"{other}{os.pathsep}/usr/bin")
    own = Path(warm_python.REAL_PYTHON).parent
    assert op_builds.build_with_this_environments_ninja() == own
    assert os.environ["PATH"] == f"{own}{os.pathsep}{other}{os.pathsep}/usr/bin"
