"""lightning-dist installed as a user installs a package: `pip install <checkout>` (not editable) into a fresh
virtual environment, then `lightning-dist-train` from another directory. The configs ship inside the package."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.cold]  # the installed entry point is its own interpreter


def _copy_checkout(destination: Path) -> Path:
    """The checkout as a clone has it: tracked files and new ones not ignored (no build outputs, no runs)."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, text=True, check=True).stdout.splitlines()
    for name in listed:
        source, target = REPO / name, destination / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the working tree
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)
    return destination


def test_a_regular_install_trains_from_another_directory(tmp_path):
    checkout = _copy_checkout(tmp_path / "checkout")
    venv = tmp_path / "venv"
    # The libraries come from this machine's site-packages (no downloads); lightning-dist itself from the checkout.
    # No pip of its own: the venv would bring an old setuptools that cannot build a wheel without `wheel`.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    # "System" is the base interpreter's site-packages, not this environment's (a venv of a venv): this environment's
    # comes first through a .pth (its setuptools builds the wheel; the base's may be one that cannot).
    (site,) = venv.glob("lib/python*/site-packages")
    (site / "this_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                              str(checkout)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    shutil.rmtree(checkout)  # nothing may be read from the source tree

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    where = subprocess.run([str(python), "-c", "import lightning_dist; print(lightning_dist.__file__)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout + where.stderr

    done = subprocess.run([str(venv / "bin" / "lightning-dist-train"), "trainer.max_steps=3"],
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run_dir,) = (elsewhere / "logs" / "train" / "runs").iterdir()
    summary = json.loads((run_dir / "metrics.json").read_text())
    assert (summary["global_step"], summary["world_size"]) == (3, 2)
    assert (run_dir / ".hydra" / "config.yaml").read_text().count("_target_: lightning_dist.strategies.DDPStrategy") == 1

    # The steps after training, as the installed `lightning-dist` runs them: the run's checkpoint as one file, and
    # text from it (3 steps teach the GPT little: what is checked is that it writes as many bytes as asked).
    last = run_dir / "checkpoints" / "last.ckpt"
    one_file = subprocess.run([str(venv / "bin" / "lightning-dist"), "consolidate", str(last), "model.ckpt"],
                              cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert (one_file.returncode, one_file.stdout.strip()) == (0, f"Consolidated {last} -> model.ckpt"), one_file.stderr
    text = subprocess.run([str(venv / "bin" / "lightning-dist"), "generate", "model.ckpt", "--prompt", "def ",
                           "--bytes", "24"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert text.returncode == 0 and text.stdout.startswith("def "), text.stderr[-2000:]
    assert len(text.stdout.removesuffix("\n")) >= len("def ") + 24 // 4, text.stdout  # 24 bytes: 6 characters or more
