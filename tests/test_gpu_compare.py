"""scripts/gpu_check.sh --cpu: the one call a lent GPU gets, rehearsed on the CPU, every part that can run there
(its report, benchmarks/gpu_compare.py scaled down to the tiny GPT on 6 steps, tensor, pipeline and context
parallelism on 2 ranks against ddp's losses on 1), so that neither the script nor its parts rot before a GPU comes;
its `--help` says what each part runs and the limits, which sum to under the call's 8 minutes.

gpu_compare's compiled rows are where `compile=true` is checked against the raw compiled loop. For ddp, fsdp
and ZeRO-2/3, torch._dynamo's counters after every step are the raw loop's: one graph for all the model's blocks
(they are alike), no graph break, nothing compiled again after the first step. Before the sanity check ran eager,
ours compiled a second graph (no-grad, then training's); ZeRO-3's hooks split each block into a graph per submodule
(24 graphs and 24 breaks for 4 blocks) until its blocks became leaf modules with their forward alone compiled."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, TRAIN_ENV, extended_run, in_the_suite

pytestmark = pytest.mark.slow

COMPILED_ROWS = ["ddp+compile", "fsdp+compile", "deepspeed_stage_2+compile", "deepspeed_stage_3+compile"]
# Each compiled row is two compilations on the CPU (a minute each under a loaded suite): the suite compiles ZeRO-3's
# (whose hooks once split every block into graphs; ddp's compiled blocks train in tests/strategies/test_regional_compile.py),
# the extended matrix all four.
COMPILED_IN_THE_SUITE = ["deepspeed_stage_3+compile"]
SCRIPT = str(REPO / "benchmarks" / "gpu_compare.py")
GPU_CHECK = str(REPO / "scripts" / "gpu_check.sh")


@pytest.fixture(scope="module")
def compiled_rows(request) -> list[str]:
    return COMPILED_ROWS if extended_run(request.config) else COMPILED_IN_THE_SUITE


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory, deepspeed_ops, compiled_rows) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """The script as the GPU machine runs it, with --cpu, from another directory: (its process, report, work)."""
    out = tmp_path_factory.mktemp("gpu_check")
    report, work = out / "GPU.md", out / "work"
    env = {**TRAIN_ENV, "PYTHON": sys.executable, "LD_GPU_CHECK_WORK": str(work),
           "LD_GPU_CHECK_ROWS": " ".join(["ddp", *compiled_rows])}
    process = subprocess.run(["bash", GPU_CHECK, "--cpu", str(report)], cwd=tmp_path_factory.mktemp("cwd"),
                             capture_output=True, text=True, timeout=2400, env=env)
    return process, report, work


@pytest.fixture(scope="module")
def report(rehearsal) -> dict:
    _, _, work = rehearsal
    table = (work / "compare" / "gpu_compare.md").read_text()
    return json.loads((work / "compare" / "gpu_compare.json").read_text()) | {"table": table}


def test_the_rehearsal_runs_every_part_the_cpu_can_within_its_limit_and_reports_each(rehearsal, compiled_rows):
    process, report, _ = rehearsal
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    took = [line for line in process.stdout.splitlines() if line.startswith("gpu_check: ")]
    assert [line.split(" took ")[0] for line in took] == [
        "gpu_check: set-up", "gpu_check: ours against raw", "gpu_check: tensor, pipeline and context parallelism",
        "gpu_check: the report"]
    assert all(line.endswith("(exit 0)") for line in took), took
    text = report.read_text()
    assert "| pytest | not run: no GPU |" in text and "| GPU | none |" in text
    assert "| row | ours step (ms) | raw step (ms) | ours/raw |" in text and f"| {compiled_rows[-1]} |" in text
    axes = {line.split(" | ")[0].strip("| "): line.split(" | ")[2] for line in text.splitlines()
            if line.startswith(("| ddp ", "| fsdp_tp ", "| fsdp_pp ", "| fsdp_cp "))}
    assert list(axes) == ["ddp", "fsdp_cp", "fsdp_pp", "fsdp_tp"]
    assert axes.pop("ddp") == "reference" and all(float(gap) < 1e-5 for gap in axes.values()), axes
    assert text.rstrip().endswith("Every part ended within its limit.")


def test_the_help_says_each_part_and_its_limit_and_the_limits_fit_the_call():
    process = subprocess.run(["bash", GPU_CHECK, "--help"], capture_output=True, text=True, timeout=60)
    assert process.returncode == 0
    limits = [int(part.split(", ")[-1].split(":")[0]) for part in re.findall(r"^  \d\. [^:]+", process.stdout, re.M)]
    assert len(limits) == 5 and sum(limits) <= 480, limits  # 8 minutes: the call's, with the start and the copy back
    assert "the GPU suite (tests/gpu), 250" in process.stdout and "--cpu" in process.stdout


def test_the_runs_it_starts_import_what_the_caller_s_path_holds(tmp_path, monkeypatch):
    """A lent GPU machine lacks deepspeed and Hydra: gpu_check.sh installs them with `--target` into a folder on
    PYTHONPATH, which every run gpu_compare starts must keep (on the H200 of 2026-12-04 each stopped with `No module
    named 'hydra'`; here they are installed, so the rehearsal could not see it)."""
    from benchmarks.gpu_compare import run

    (tmp_path / "only_on_the_callers_path.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    run([sys.executable, "-c", "import only_on_the_callers_path, lightning_dist"], "cpu")  # SystemExit if not


def test_the_gpu_suite_runs_on_one_device_only_presets_one_device_holds():
    """The GPU suite's one-device presets each lay out on 1 rank (on the H200 of 2026-12-04 the pipeline presets,
    which need 2 stages, were refused there)."""
    from lightning_dist.parallel.sizes import ParallelSizes
    from lightning_dist.run.config_check import check_overrides
    from tests.gpu.conftest import ONE_DEVICE_NAMES, PRESET_NAMES

    for name in ONE_DEVICE_NAMES:
        ParallelSizes.from_config(check_overrides([f"strategy={name}"]).strategy).check(devices=1, num_nodes=1)
    left_out = {"fsdp_pp", "fsdp_tp_pp", "fsdp_tp", "hsdp_tp", "deepspeed_stage_3_offload_nvme"}
    assert sorted(ONE_DEVICE_NAMES) == sorted(set(PRESET_NAMES) - left_out)  # NVMe: a test of its own
    for name in left_out - {"deepspeed_stage_3_offload_nvme"}:
        with pytest.raises(ValueError):
            ParallelSizes.from_config(check_overrides([f"strategy={name}"]).strategy).check(devices=1, num_nodes=1)


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


def test_a_row_above_the_limit_comes_back_with_where_ours_spent_its_host_time(tmp_path):
    """A gap found on a lent GPU is profiled in the same call (the H200's fsdp 1.079 came back unexplained: no
    device time was left to profile it by hand). Forced here for ddp on the tiny GPT, whatever its ratio."""
    out = tmp_path / "compare"
    process = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--shape", "tiny", "--steps", "6", "--rows",
                              "ddp", "--split-above", "0", "--out", str(out)], cwd=tmp_path, capture_output=True,
                             text=True, timeout=900, env=TRAIN_ENV)
    assert process.returncode == 0, process.stderr[-3000:]
    found = json.loads((out / "gpu_compare.json").read_text())["time_split"]["ddp"]
    for side in ("ours", "raw"):
        assert found[side]["Python"] > 0 and found[side]["autograd engine"] > 0, found[side]
        assert found[side]["collectives"] < found[side]["Python"]  # one rank: no peer to wait for
    assert len(found["gap"]) == 8 and found["gap"][0][0] >= found["gap"][-1][0]
    table = (out / "gpu_compare.md").read_text()
    assert "Where ddp's host time went, rank 0, steps 10-19 under cProfile (seconds):" in table
    assert re.search(r"\| ours \| [0-9.]+ \| [0-9.]+ \|", table) and "Own time ours spent beyond raw's: " in table
