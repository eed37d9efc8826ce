"""The suite's warm interpreter (tests/warm_python.py) behaves as a fresh `python` would, seen from outside: its
arguments, directory, environment, streams, exit codes and signals; and it has imported no Lightning nor our code."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import warm_python
from tests.conftest import TRAIN_ENV

pytestmark = pytest.mark.skipif(os.environ.get("LD_TESTS_COLD") == "1", reason="the suite runs cold: no warm interpreter")


def python(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60, **kwargs)


def test_the_suites_python_is_the_warm_launcher():
    assert sys.executable != warm_python.REAL_PYTHON and Path(sys.executable).name == "python"


def test_arguments_directory_environment_streams_and_exit_code(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import os, sys\nprint(sys.argv, os.getcwd(), os.environ['PROBE'], sys.path[0])\n"
                      "print('to stderr', file=sys.stderr)\nsys.exit(3)\n")
    done = python(str(script), "a", "b c", cwd=tmp_path, env={**os.environ, "PROBE": "seen"})
    assert done.returncode == 3
    assert done.stdout == f"{[str(script), 'a', 'b c']} {tmp_path} seen {tmp_path}\n"
    assert done.stderr == "to stderr\n"


def test_a_module_and_code_run_as_main():
    assert python("-m", "json.tool", "--help").stdout.startswith("usage: python -m json.tool")
    assert python("-c", "import sys; print(__name__, sys.argv)", "x").stdout == "__main__ ['-c', 'x']\n"


def test_an_uncaught_error_prints_its_traceback_and_exits_1():
    done = python("-c", "raise ValueError('boom')")
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == "ValueError: boom"


def test_a_process_killed_by_a_signal_reads_as_killed_by_it():
    assert python("-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)").returncode == -signal.SIGTERM


def test_signals_reach_the_process_and_it_dies_with_its_launcher(tmp_path):
    pid_file = tmp_path / "pid"
    code = (f"import os, signal, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
            "signal.signal(signal.SIGTERM, lambda *_: print('got SIGTERM', flush=True))\ntime.sleep(60)\n")
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    while not pid_file.exists() or not pid_file.read_text():
        time.sleep(0.05)
    launcher.send_signal(signal.SIGTERM)  # forwarded: the handler runs, the sleep goes on
    assert launcher.stdout.readline() == "got SIGTERM\n"
    launcher.kill()  # SIGKILL cannot be forwarded: the process sees its launcher gone and ends itself
    launcher.wait()
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]:
        assert time.monotonic() < deadline, "the process outlived its launcher"
        time.sleep(0.05)


def test_a_kill_of_its_own_process_group_reaches_no_further():
    """The fault loop's probe kills every rank by killing its process group: in the warm interpreter that group is
    the process's own, never the suite's (this test would end the suite otherwise)."""
    done = python("-c", "import os, signal; os.killpg(os.getpgid(0), signal.SIGKILL)")
    assert done.returncode == -signal.SIGKILL  # and this process, the suite's, is still here to see it
    assert int(python("-c", "import os; print(os.getpgid(0))").stdout) != os.getpgid(0)


def test_libraries_are_preloaded_but_not_lightning_nor_ours():
    done = python("-c", "import sys; print(sorted(m for m in ('torch', 'deepspeed', 'lightning', 'lightning_dist')"
                        " if m in sys.modules))")
    assert done.stdout == "['deepspeed', 'torch']\n"


def test_the_preloaded_objects_are_frozen_out_of_each_child_s_collections():
    frozen = int(python("-c", "import gc; print(gc.get_freeze_count())").stdout)
    assert frozen > 100_000  # torch's, DeepSpeed's, Hydra's...: a full collection or the child's exit walked them all


def test_py_cpuinfo_s_probe_runs_in_a_fresh_interpreter(tmp_path):
    """DeepSpeed's op builders run `python .../cpuinfo/cpuinfo.py --json`: a fresh interpreter starts it for less."""
    probe = tmp_path / "cpuinfo" / "cpuinfo.py"
    probe.parent.mkdir()
    probe.write_text("import gc, sys; print('torch' in sys.modules, gc.get_freeze_count(), sys.argv[1:])\n")
    assert python(str(probe), "--json").stdout == "False 0 ['--json']\n"


def test_runs_are_warm_and_see_what_the_imports_set_in_the_environment():
    # torch._dynamo's import sets TORCHINDUCTOR_CACHE_DIR: compared with the warm process's environment after its
    # imports, every run looked changed and started cold (a whole suite run so, 30% slower).
    code = "import os, sys; print(os.getppid() != int(sys.argv[1]), os.environ.get('TORCHINDUCTOR_CACHE_DIR'))"
    fresh = subprocess.run([warm_python.REAL_PYTHON, "-c", "import os, torch._dynamo;"
                            " print(os.environ['TORCHINDUCTOR_CACHE_DIR'])"], capture_output=True, text=True)
    assert python("-c", code, str(os.getpid())).stdout == f"True {fresh.stdout.strip()}\n"
    # As the runs are started: with the environment the suite was started with (TRAIN_ENV), from before the suite's
    # own imports of torch._dynamo, which add the variable to this process's. Taken after them, it made every run cold.
    assert python("-c", code, str(os.getpid()), env=TRAIN_ENV).stdout == f"True {fresh.stdout.strip()}\n"


def test_a_variable_dynamo_reads_at_import_is_read_by_a_fresh_interpreter():
    code = "import torch._inductor.config as c; print(c.force_disable_caches)"
    assert python("-c", code).stdout == "False\n"
    done = python("-c", code, env={**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"})
    assert done.stdout == "True\n"


def test_warnings_options_from_the_environment_apply():
    code = "import warnings; warnings.warn('shown', UserWarning)"
    assert "UserWarning: shown" in python("-c", code).stderr
    done = python("-c", code, env={**os.environ, "PYTHONWARNINGS": "ignore::UserWarning"})
    assert done.returncode == 0 and done.stderr == ""
