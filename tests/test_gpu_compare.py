"""benchmarks/gpu_compare.py, scaled down to a CPU (the tiny GPT, 6 steps), as the GPU run's rows run it: the script
does not rot, and its compiled rows are where `compile=true` is checked against the raw compiled loop. For ddp, fsdp
and ZeRO-2/3, torch._dynamo's counters after every step are the raw loop's: one graph for all the model's blocks
(they are alike), no graph break, nothing compiled again after the first step. Before the sanity check ran eager,
ours compiled a second graph (no-grad, then training's); ZeRO-3's hooks split each block into a graph per submodule
(24 graphs and 24 breaks for 4 blocks) until its blocks became leaf modules with their forward alone compiled."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, TRAIN_ENV, extended_run, in_the_suite

pytestmark = pytest.mark.slow

COMPILED_ROWS = ["ddp+compile", "fsdp+compile", "deepspeed_stage_2+compile", "deepspeed_stage_3+compile"]
# Each compiled row is two compilations on the CPU (a minute each under a loaded suite): the suite compiles ddp's and
# ZeRO-3's (whose hooks once split every block into graphs), the extended matrix all four.
COMPILED_IN_THE_SUITE = ["ddp+compile", "deepspeed_stage_3+compile"]
SCRIPT = str(REPO / "benchmarks" / "gpu_compare.py")
COMMAND = [sys.executable, SCRIPT, "--device", "cpu", "--shape", "tiny", "--steps", "6"]


@pytest.fixture(scope="module")
def compiled_rows(request) -> list[str]:
    return COMPILED_ROWS if extended_run(request.config) else COMPILED_IN_THE_SUITE


@pytest.fixture(scope="module")
def report(tmp_path_factory, deepspeed_ops, compiled_rows) -> dict:
    out = tmp_path_factory.mktemp("gpu_compare")
    process = subprocess.run([*COMMAND, "--rows", "ddp", *compiled_rows, "--out", str(out)], cwd=tmp_path_factory.mktemp("cwd"),
                             capture_output=True, text=True, timeout=1200, env=TRAIN_ENV)
    assert process.returncode == 0, process.stdout[-2000:] + process.stderr[-3000:]
    table = (out / "gpu_compare.md").read_text()
    assert process.stdout.strip().endswith(table.strip().splitlines()[-1])
    return json.loads((out / "gpu_compare.json").read_text()) | {"table": table}


def test_the_help_documents_the_default_gpu_run():
    process = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, timeout=120)
    assert process.returncode == 0
    assert "python benchmarks/gpu_compare.py                 # 303.6M GPT, T 1024, batch 8, bf16-mixed, 7 rows: ~7 min" in process.stdout


def test_every_row_has_both_sides_timed_and_a_plan(report, compiled_rows):
    assert list(report["rows"]) == ["ddp", *compiled_rows]
    for row, sides in report["rows"].items():
        for side in ("ours", "raw"):
            assert len(sides[side]["step_s"]) == 5 and all(0 < step < 10 for step in sides[side]["step_s"]), (row, side)
            assert sides[side]["peak_bytes"] > 1e8
        assert sides["plan_bytes"] > 0
        assert sides["ours"]["host_syncs_per_quiet_step"] == 0, row
    lines = report["table"].splitlines()
    assert lines[2].startswith("| row | ours step (ms) | raw step (ms) | ours/raw |")
    assert len(lines) == 4 + 1 + len(compiled_rows)


@pytest.mark.parametrize("row", in_the_suite(COMPILED_ROWS, COMPILED_IN_THE_SUITE))
def test_compiled_blocks_compile_as_the_raw_compiled_loop_does(report, row):
    ours, raw = (report["rows"][row][side]["dynamo"] for side in ("ours", "raw"))
    assert (len(ours), len(raw)) == (6 + 6, 6)  # ours: the counted steps too
    assert [step["unique_graphs"] for step in ours[:6]] == [step["unique_graphs"] for step in raw] == [1] * 6
    assert [step["graph_breaks"] for step in ours] == [0] * 12 and [step["graph_breaks"] for step in raw] == [0] * 6
    assert ours[-1]["unique_graphs"] == 1  # nothing compiled again, under the host-sync counter either
