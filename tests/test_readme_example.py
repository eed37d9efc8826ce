"""The README's plain-Lightning example, extracted from README.md and run as written, from an empty directory: a
module and data of the user's own, sharded by `ld_fsdp` over two CPU processes, its checkpoint loaded back."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, TRAIN_ENV

pytestmark = pytest.mark.slow


def readme_example() -> str:
    text = (REPO / "README.md").read_text()
    (code,) = re.findall(r"<!-- plain-lightning-example -->\n```python\n(.*?)```\n<!-- /plain-lightning-example -->",
                         text, flags=re.S)
    return code


def test_the_plain_lightning_example_runs_as_written_from_an_empty_directory(tmp_path):
    script = tmp_path / "my_model.py"  # the name the README gives it
    script.write_text(readme_example())
    process = subprocess.run([sys.executable, "my_model.py"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=600, env=TRAIN_ENV)
    assert process.returncode == 0, process.stderr[-3000:]
    (loaded,) = [line for line in process.stdout.splitlines() if line.startswith("Loaded ")]
    checkpoint = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "epoch=2-step=96.ckpt"
    assert loaded.startswith(f"Loaded {checkpoint}: mse ")
    assert float(loaded.rsplit(" ", 1)[1]) < 0.1  # trained: the target varies by 0.52 (its variance)
    shards = sorted(p.name for p in checkpoint.iterdir())  # FSDP's checkpoint directory: a file per rank
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json", "meta.pt"]
    # A plain script with our strategy: no advert, and DeepSpeed's and Lightning's noise as in train.py's runs.
    output = process.stdout + process.stderr
    assert "💡" not in output and "Setting accelerator to CPU" not in output
