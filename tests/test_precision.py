"""The strategy x precision matrix of docs/precision.md: every cell either trains with the dtypes it names or is refused
before launch with a message that says why and what to choose instead."""

from __future__ import annotations

import re

import pytest

from tests.conftest import cpu_has_fp16, in_the_suite, run_train

pytestmark = pytest.mark.slow

FP32, BF16, FP16 = "torch.float32", "torch.bfloat16", "torch.float16"

# (strategy, precision) -> dtypes read from the running ranks: stored parameters, what the optimizer updates
# (the master weights) and, for FSDP, what parameters are all-gathered in for compute.
RUNS = {
    ("ddp", "32-true"): (FP32, FP32, []),
    ("ddp", "bf16-mixed"): (FP32, FP32, []),  # autocast computes in bf16
    ("ddp", "bf16-true"): (BF16, BF16, []),
    ("fsdp", "32-true"): (FP32, FP32, [FP32]),
    ("fsdp", "bf16-mixed"): (FP32, FP32, [BF16]),
    ("fsdp", "bf16-true"): (BF16, BF16, [BF16]),
    ("deepspeed_stage_2", "32-true"): (FP32, FP32, []),
    ("deepspeed_stage_2", "bf16-mixed"): (BF16, FP32, []),
    ("deepspeed_stage_2", "bf16-true"): (BF16, FP32, []),
    ("deepspeed_stage_3", "32-true"): (FP32, FP32, []),
    ("deepspeed_stage_3", "bf16-mixed"): (BF16, FP32, []),
    ("deepspeed_stage_3", "bf16-true"): (BF16, FP32, []),
}
REFUSALS = {
    ("ddp", "16-mixed"): "trainer.precision=16-mixed: DDPStrategy has no fp16 on CPU (Lightning would silently switch to bf16-mixed); choose 32-true, bf16-mixed or bf16-true",
    ("fsdp", "16-mixed"): "trainer.precision=16-mixed: FSDPStrategy (FSDP2) has no fp16 loss scaling",
}
# DeepSpeed's fp16 on CPU needs AVX512-FP16/AMX-FP16: where the CPU has it, these cells train; elsewhere, refused.
for _name in ("deepspeed_stage_2", "deepspeed_stage_3"):
    if cpu_has_fp16():
        RUNS[(_name, "16-mixed")] = (FP16, FP32, [])
    else:
        REFUSALS[(_name, "16-mixed")] = "trainer.precision=16-mixed: DeepSpeed's CPU accelerator has no fp16 on this CPU"


# In the suite: 32-true (the acceptance runs), bf16-mixed under DDP, bf16-true under FSDP (it gathers in bf16), fp16
# where the CPU has it; the other cells in scripts/extended_checks.sh.
EXTENDED_CELLS = [("ddp", "bf16-true"), ("fsdp", "bf16-mixed"), ("deepspeed_stage_2", "bf16-mixed"),
                  ("deepspeed_stage_2", "bf16-true"), ("deepspeed_stage_3", "bf16-mixed"), ("deepspeed_stage_3", "bf16-true")]


@pytest.mark.parametrize("cell", in_the_suite(list(RUNS), [cell for cell in RUNS if cell not in EXTENDED_CELLS]),
                         ids=["-".join(cell) for cell in RUNS])
def test_cell_trains_with_the_named_dtypes(cell, trained_runs):
    name, precision = cell
    # 32-true is the default: the same run as the acceptance tests in test_train_strategies.py.
    overrides = () if precision == "32-true" else (f"trainer.precision={precision}", "trainer.max_steps=6", "test=false")
    run = trained_runs(name, *overrides)
    assert run.process.returncode == 0, run.output[-3000:]
    parameters, master, gathered = RUNS[cell]
    for rank in run.summary["placement_per_rank"]:
        assert (rank["parameter_dtypes"], rank["master_dtypes"], rank["fsdp_gathered_dtypes"]) == ([parameters], [master], gathered)
    losses = run.val_losses()
    assert losses[max(losses)] < losses[0] - 0.1, losses


@pytest.mark.parametrize("cell", REFUSALS, ids="-".join)
def test_cell_is_refused_before_launch(cell, tmp_path):
    name, precision = cell
    run = run_train(tmp_path, f"strategy={name}", "trainer.accelerator=cpu", "trainer.devices=2", f"trainer.precision={precision}")
    assert run.process.returncode == 2
    assert run.process.stderr.strip().splitlines()[-1].startswith(f"error: {REFUSALS[cell]}")
    assert not (tmp_path / "train_ddp_process_1.log").exists()  # no rank was started


def readme_matrix() -> dict[tuple[str, str], str]:
    """docs/precision.md's table: (strategy, precision) -> the cell's text."""
    from tests.conftest import REPO

    section = (REPO / "docs" / "precision.md").read_text().split("\n\n| strategy ", 1)[1]
    table = ("| strategy " + section).split("\n\n", 1)[0].splitlines()
    (_, *precisions), _, *body = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in table]
    return {(row[0], precision): cell for row in body for precision, cell in zip(precisions, row[1:])}


SHORT_NAMES = {FP32: "fp32", BF16: "bf16", FP16: "fp16"}


def test_every_cell_of_the_readme_says_what_the_tests_check():
    matrix = readme_matrix()
    assert set(matrix) == set(RUNS) | set(REFUSALS)
    for cell, (parameters, master, gathered) in RUNS.items():
        says = f"params {SHORT_NAMES[parameters]}, master {SHORT_NAMES[master]}"
        if gathered:
            says += f", all-gathered in {SHORT_NAMES[gathered[0]]}"
        assert says in matrix[cell], (cell, matrix[cell])
    for cell, message in REFUSALS.items():
        reason = re.split(r" \(|;", message.split(" has ", 1)[1])[0]  # e.g. "no fp16 loss scaling"
        assert "refused" in matrix[cell] and reason in matrix[cell], (cell, matrix[cell], reason)
