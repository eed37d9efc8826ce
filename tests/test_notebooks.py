"""The notebooks run top to bottom in a fresh kernel, training under multi-process strategies from inside it; and a
rank that fails there raises in its cell instead of hanging the kernel."""

from __future__ import annotations

import os
import time

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from nbformat.v4 import new_code_cell, new_notebook

from tests.conftest import REPO, in_the_suite

# Cold: a kernel chooses matplotlib's inline backend as it starts, and the warm interpreter has imported matplotlib
# (torchmetrics does) before any kernel existed.
pytestmark = [pytest.mark.slow, pytest.mark.cold]

NOTEBOOKS = REPO / "notebooks"


@pytest.fixture(autouse=True)
def kernel_finds_the_package(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    # Two OpenMP threads in the kernel, as after any in-process Lightning run sets OMP_NUM_THREADS: forked ranks
    # once hung on the kernel's thread pool then.
    monkeypatch.setenv("OMP_NUM_THREADS", "2")


def execute(notebook, timeout: int = 600):
    NotebookClient(notebook, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return notebook


def outputs(notebook) -> str:
    return "".join(o.get("text", "") + o.get("data", {}).get("text/markdown", "")
                   for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs)


def test_quickstart_trains_three_strategies_in_the_kernel_with_coinciding_curves(deepspeed_ops):
    notebook = execute(nbformat.read(NOTEBOOKS / "quickstart.ipynb", as_version=4))
    text = outputs(notebook)
    for name in ("ld_ddp", "ld_fsdp", "ld_deepspeed_stage_3"):
        # The mean of the 2 ranks' losses (models/gpt.py logs the data-parallel mean); the notebook itself asserts
        # the curves coincide.
        assert f"{name:22} 30 steps, loss 5.4255 -> " in text
    assert any("image/png" in o.get("data", {}) for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs)


def test_memory_notebook_plans_chooses_and_generates_from_a_consolidated_checkpoint(deepspeed_ops):
    text = outputs(execute(nbformat.read(NOTEBOOKS / "memory_and_strategy.ipynb", as_version=4)))
    assert "**6.45B parameters, bf16-mixed, 8 devices**" in text
    assert "| deepspeed_stage_3 | 12.9 |" in text
    assert "8 x 80 GB, 512 GB host: deepspeed_stage_2 (29.3 GB per device)" in text
    assert "8 x 24 GB, 512 GB host: deepspeed_stage_3 (18.4 GB per device)" in text
    assert "8 x 16 GB, 512 GB host: deepspeed_stage_3_offload" in text
    assert "checkpoint: ['checkpoint', 'latest'," in text
    assert "The " in text.splitlines()[-1]


FAILING_RANK = '''
import sys
import lightning as L
import lightning_dist
from lightning_dist.data.pydoc_text import PydocTextDataModule
from lightning_dist.models.gpt import GPTLanguageModel

class FailsOnRankOne(GPTLanguageModel):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 2:
            raise RuntimeError("rank 1 gave up at step 2")
        return super().training_step(batch, batch_idx)

trainer = L.Trainer(strategy="{strategy}", accelerator="cpu", devices=2, max_steps=50, limit_val_batches=0, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(FailsOnRankOne(n_layer=2, d_model=64, block_size=64), datamodule=PydocTextDataModule(block_size=64))
'''


@pytest.mark.parametrize("strategy", in_the_suite(["ld_fsdp", "ld_deepspeed_stage_3"], ["ld_fsdp"]))
def test_a_failing_rank_raises_in_its_cell_within_a_minute(strategy, tmp_path, deepspeed_ops):
    notebook = new_notebook(cells=[new_code_cell("import lightning_dist"), new_code_cell(FAILING_RANK.format(strategy=strategy))])
    client = NotebookClient(notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    with client.setup_kernel():
        client.execute_cell(notebook.cells[0], 0)
        started = time.monotonic()
        with pytest.raises(CellExecutionError) as error:
            client.execute_cell(notebook.cells[1], 1)
        elapsed = time.monotonic() - started
    assert "ProcessRaisedException" in str(error.value) and "rank 1 gave up at step 2" in str(error.value)
    assert elapsed < 60, elapsed
