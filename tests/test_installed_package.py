"""lightning-dist released and installed as a user installs it: `python -m build` makes the sdist and, from it, the
wheel (cleanly: no warning), and a fresh virtual environment installs that wheel; then, from another directory with
no checkout anywhere, the main command (`lightning-dist-train`), the README's plain-Lightning example, and the steps
after training (`lightning-dist consolidate`, `export`, `generate`), for the bundled GPT and a Hugging Face model. The
configs ship inside the wheel."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest
import tomllib

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


def readme_example() -> str:
    text = (REPO / "README.md").read_text()
    (code,) = re.findall(r"<!-- plain-lightning-example -->\n```python\n(.*?)```\n<!-- /plain-lightning-example -->",
                         text, flags=re.S)
    return code


def check_readme_example_ran(process: subprocess.CompletedProcess, directory: Path) -> None:
    """The example sharded the user's module with `ld_fsdp` over two CPU processes and loaded its checkpoint back."""
    assert process.returncode == 0, process.stderr[-3000:]
    (loaded,) = [line for line in process.stdout.splitlines() if line.startswith("Loaded ")]
    checkpoint = directory / "lightning_logs" / "version_0" / "checkpoints" / "epoch=2-step=96.ckpt"
    assert loaded.startswith(f"Loaded {checkpoint}: mse ")
    assert float(loaded.rsplit(" ", 1)[1]) < 0.1  # trained: the target varies by 0.52 (its variance)
    shards = sorted(p.name for p in checkpoint.iterdir())  # FSDP's checkpoint directory: a file per rank
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json", "meta.pt"]
    # A plain script with our strategy: no advert, and DeepSpeed's and Lightning's noise as in train.py's runs.
    output = process.stdout + process.stderr
    assert "💡" not in output and "Setting accelerator to CPU" not in output


def _built(checkout: Path, dist: Path) -> tuple[Path, Path]:
    """The sdist and the wheel `python -m build` makes of the checkout (the wheel from the sdist), checked."""
    # No build isolation: the build backend (setuptools) comes from this environment, not from a download.
    build = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(checkout)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    lines = (build.stdout + build.stderr).splitlines()  # setuptools' warnings, and Python's
    warned = [line for line in lines if (line.lower().startswith("warning") or "Warning:" in line)
              and "byte-compiling is disabled" not in line]
    assert warned == []  # a deprecated key or classifier would break the build on a later setuptools
    version = tomllib.loads((checkout / "pyproject.toml").read_text())["project"]["version"]
    sdist, wheel = dist / f"lightning_dist-{version}.tar.gz", dist / f"lightning_dist-{version}-py3-none-any.whl"
    assert sorted(dist.iterdir()) == [wheel, sdist]
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml", "lightning_dist/conf/train.yaml"} <= names
    assert not any(name.startswith("tests/") for name in names)
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(f"lightning_dist-{version}.dist-info/METADATA").decode()
    assert {"lightning_dist/conf/train.yaml", "lightning_dist/conf/strategy/deepspeed_stage_3_offload.yaml",
            "lightning_dist/conf/model/hf_llama.yaml", "lightning_dist/conf/lora/default.yaml",
            f"lightning_dist-{version}.dist-info/licenses/LICENSE"} <= names
    fields = [line.split(": ", 1) for line in metadata.splitlines() if ": " in line and not line.startswith(" ")]
    assert ["License-Expression", "Apache-2.0"] in fields and ["Requires-Dist", "torch<2.16,>=2.11"] in fields
    urls = dict(value.split(", ", 1) for key, value in fields if key == "Project-URL")
    assert len(urls) >= 3 and all(url.startswith(urls["Source"]) for url in urls.values())  # one base: the repository's
    return sdist, wheel


def test_the_built_wheel_installs_and_trains_from_another_directory(tmp_path):
    checkout = _copy_checkout(tmp_path / "checkout")
    _, wheel = _built(checkout, tmp_path / "dist")
    venv = tmp_path / "venv"
    # The libraries come from this machine's site-packages (no downloads); lightning-dist itself from the wheel.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    # "System" is the base interpreter's site-packages, not this environment's (a venv of a venv): this environment's
    # comes first through a .pth (the pip that installs the wheel).
    (site,) = venv.glob("lib/python*/site-packages")
    (site / "this_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
                             capture_output=True, text=True, timeout=600)
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
    config = (run_dir / ".hydra" / "config.yaml").read_text()
    assert config.count("_target_: lightning_dist.strategies.DDPStrategy") == 1

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

    # A Hugging Face model from the package's configs (the hf extra), then as a save_pretrained folder that
    # transformers loads, and text from that folder: the export is of the newest run, this one.
    hf_run = subprocess.run([str(venv / "bin" / "lightning-dist-train"), "model=hf_gpt2", "trainer.devices=1",
                             "trainer.max_steps=2"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert hf_run.returncode == 0, hf_run.stdout[-3000:] + hf_run.stderr[-3000:]
    exported = subprocess.run([str(venv / "bin" / "lightning-dist"), "export", "my_gpt2"], cwd=elsewhere, env=env,
                              capture_output=True, text=True, timeout=300)
    assert (exported.returncode, exported.stdout) == (0, "save_pretrained folder: my_gpt2\n"), exported.stderr
    assert {"config.json", "model.safetensors"} <= {p.name for p in (elsewhere / "my_gpt2").iterdir()}
    text = subprocess.run([str(venv / "bin" / "lightning-dist"), "generate", "my_gpt2", "--prompt", "def ",
                           "--tokens", "24"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert text.returncode == 0 and text.stdout.startswith("def "), text.stderr[-2000:]
    assert len(text.stdout.removesuffix("\n")) >= len("def ") + 24 // 4, text.stdout

    # The README's plain-Lightning example, as a user saves and runs it beside nothing but the installed package.
    script = elsewhere / "my_model.py"
    script.write_text(readme_example())
    example = subprocess.run([str(python), "my_model.py"], cwd=elsewhere, env=env, capture_output=True, text=True,
                             timeout=600)
    check_readme_example_ran(example, elsewhere)
