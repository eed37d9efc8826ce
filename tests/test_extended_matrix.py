"""The suite runs one case per engine of its matrices; the rest is marked `extended`, deselected unless asked for
(`bash scripts/extended_checks.sh`, `-m extended`), never skipped."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import CURVES_IN_THE_SUITE, REPO, STRATEGY_NAMES, in_the_suite


def test_the_cases_not_kept_are_marked_extended():
    cases = in_the_suite(["ddp", "fsdp", "deepspeed_stage_3"], ["fsdp"])
    assert cases[1] == "fsdp"
    assert [case.values for case in (cases[0], cases[2])] == [("ddp",), ("deepspeed_stage_3",)]
    assert all([mark.name for mark in case.marks] == ["extended"] for case in (cases[0], cases[2]))
    (pair,) = in_the_suite([("ddp", "fsdp")], [], unpack=True)
    assert pair.values == ("ddp", "fsdp")


def test_a_kept_case_that_is_no_case_is_refused():
    with pytest.raises(AssertionError, match="kept cases that are not cases: \\['fsdp_tp'\\]"):
        in_the_suite(["ddp", "fsdp"], ["fsdp_tp"])


def test_the_suite_reads_one_curve_per_engine_and_offload():
    assert set(CURVES_IN_THE_SUITE) <= set(STRATEGY_NAMES)
    assert {"ddp", "fsdp", "deepspeed_stage_2", "deepspeed_stage_3",
            "deepspeed_stage_3_offload"} <= set(CURVES_IN_THE_SUITE)


def collected(*options: str) -> list[str]:
    process = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                              "-n", "0", *options, "tests/test_precision.py"], cwd=REPO, capture_output=True,
                             text=True, timeout=300)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    return [line for line in process.stdout.splitlines() if "::" in line]


def test_the_suite_deselects_the_extended_cases_and_the_script_selects_only_them():
    suite, extended = collected(), collected("-m", "extended")
    extended_cells = ["ddp-bf16-true", "fsdp-bf16-mixed", "deepspeed_stage_2-bf16-mixed", "deepspeed_stage_2-bf16-true",
                      "deepspeed_stage_3-bf16-mixed", "deepspeed_stage_3-bf16-true"]
    assert [test.split("[")[1].rstrip("]") for test in extended] == extended_cells
    assert not set(suite) & set(extended) and "test_cell_trains_with_the_named_dtypes[fsdp-bf16-true]" in "".join(suite)
    script = (REPO / "scripts" / "extended_checks.sh").read_text()
    assert 'python -m pytest -m extended "$@"' in script
