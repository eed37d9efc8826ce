"""Hydra sweeps with multi-process strategies, one output directory per run, failures that stay in their job."""

from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import BATCH_PROBE, REPO, documented, run_documented
from tests.probes import read_batches

pytestmark = pytest.mark.slow

SHORT = ("trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=4", "test=false")
PROBE = ("+callbacks.cmdline_probe._target_=tests.probes.CommandLineProbe", "+callbacks.cmdline_probe.directory=${paths.output_dir}",
         *BATCH_PROBE)


def train(*args: str, cwd: Path = REPO, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(REPO / "train.py"), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def job_dirs(sweep_dir: Path) -> list[Path]:
    return sorted(p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith("."))


README = REPO / "README.md"
SWEEP = documented(README, "python train.py -m strategy=")  # the README's sweep, exactly as written


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, deepspeed_ops):
    """The README's sweep command, run as typed from a fresh working directory (no hydra.sweep.dir)."""
    cwd = tmp_path_factory.mktemp("readme_sweep")
    process = run_documented(SWEEP, cwd)
    multiruns = cwd / "logs" / "train" / "multiruns"
    dates = sorted(multiruns.iterdir()) if multiruns.is_dir() else []
    return process, cwd, dates


def test_the_readme_sweep_runs_as_written_into_logs_train_multiruns(sweep):
    process, cwd, dates = sweep
    assert process.returncode == 0, process.stderr[-4000:]
    assert len(dates) == 1 and sorted(p.name for p in cwd.iterdir()) == ["logs"]  # one launch, one sweep directory
    jobs = job_dirs(dates[0])
    strategies = [part.split("=")[1] for part in SWEEP.split() if part.startswith("strategy=")][0].split(",")
    assert [p.name for p in jobs] == [str(n) for n in range(len(strategies))] and len(jobs) == 2
    steps = int(SWEEP.split("trainer.max_steps=")[1].split()[0])
    for job, strategy in zip(jobs, strategies):
        summary = json.loads((job / "metrics.json").read_text())
        assert (summary["world_size"], summary["global_step"], summary["train_batches_per_rank"]) == (2, steps, [steps] * 2)
        assert (job / "checkpoints" / "last.ckpt").exists()
        assert yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())[0] == f"strategy={strategy}"
        # Rank 1 ran in the job's own directory, from the job's own command line (Lightning names its log so).
        assert (job / "train_ddp_process_1.log").exists()
    # Its last words: where it went, and the report's command for it (the README's second line, with the date).
    where = dates[0].relative_to(cwd)
    assert process.stdout.rstrip().splitlines()[-2:] == [
        f"Sweep: {where}", f"Compare its jobs: python -m lightning_dist.sweep_report {where}"]


def test_the_readme_sweep_report_command_writes_a_table_and_a_readable_plot(sweep):
    _, cwd, dates = sweep
    command = documented(README, "python -m lightning_dist.sweep_report")
    process = run_documented(command.replace("<date>", dates[0].name), cwd)
    assert process.returncode == 0, process.stderr[-3000:]
    table, image = dates[0] / "sweep_report.md", dates[0] / "sweep_report.png"
    rows = [line for line in table.read_text().splitlines() if line.startswith("| ") and not line.startswith("| job")]
    assert [row.split(" | ")[1:3] for row in rows] == [["`strategy=ddp`", "finished"], ["`strategy=fsdp`", "finished"]]
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and image.stat().st_size > 20_000


def test_plot_has_labelled_axes_and_one_series_per_job(sweep, monkeypatch):
    import matplotlib.figure

    from lightning_dist.reports import sweep_report

    _, _, dates = sweep
    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, *a, **k: figures.append(self))
    jobs = sweep_report.read_jobs(dates[0])
    sweep_report.plot(jobs, dates[0] / "unused.png")
    axes = figures[0].axes
    assert all(ax.get_xlabel() and ax.get_ylabel() and ax.get_title() for ax in axes)
    assert [len(ax.get_lines()) for ax in axes[:2]] == [2, 2]  # a loss curve per job
    # The axis of steps done covers the run (trainer.max_steps=20 in the README's sweep): its last step's loss is at 20.
    assert [ax.get_xlim() for ax in axes[:2]] == [(0, 20), (0, 20)]
    assert max(axes[1].get_lines()[0].get_xdata()) == 20 and min(axes[0].get_lines()[0].get_xdata()) == 0
    assert [len(ax.patches) for ax in axes[2:]] == [2, 2]  # a bar per job
    assert [t.get_text() for t in axes[0].get_legend().get_texts()] == ["strategy=ddp", "strategy=fsdp"]
    # The curves come from metrics.json, whichever loggers ran: they are the CSV logger's values.
    for job in jobs:
        with open(job.directory / "csv" / "metrics.csv") as handle:
            rows = list(csv.DictReader(handle))
        assert job.train_loss == {int(r["step"]): float(r["train_loss"]) for r in rows if r.get("train_loss")}
        assert job.val_loss == {int(r["step"]): float(r["val_loss"]) for r in rows if r.get("val_loss")}


def test_the_metrics_file_reports_speed_and_memory(trained_runs):
    run = trained_runs("ddp")
    summary = run.summary
    assert 0 < summary["median_step_time_s"] < 60
    # Checked against what the batches held (counted from the batches themselves on every rank) and how long the
    # steps took by another clock: the median of BatchProbe's own step times.
    ranks = read_batches(run.run_dir)
    assert len(ranks) == 2
    per_step = [{key: sum(rank[i][key] for rank in ranks) for key in ("samples", "tokens")} for i in range(len(ranks[0]))]
    assert all(step == per_step[0] for step in per_step)
    probe_step_time = statistics.median(batch["seconds"] for batch in ranks[0][1:])  # the first step warms up
    assert summary["samples_per_s"] == pytest.approx(per_step[0]["samples"] / probe_step_time, rel=0.2)
    assert summary["tokens_per_s"] == pytest.approx(per_step[0]["tokens"] / probe_step_time, rel=0.2)
    assert [rank["kind"] for rank in summary["peak_memory_per_rank"]] == ["process_peak_rss"] * 2
    assert all(100 * 2**20 < rank["bytes"] < 8 * 2**30 for rank in summary["peak_memory_per_rank"])
    assert set(summary["metrics"]) >= {"train_loss", "val_loss"}


def test_run_dir_with_a_timestamp_is_one_directory_for_all_ranks(tmp_path, deepspeed_ops):
    process = train("strategy=deepspeed_stage_2", *SHORT, *PROBE, "hydra.run.dir=outputs/${now:%H-%M-%S-%f}", cwd=tmp_path)
    assert process.returncode == 0, process.stderr[-3000:]
    (run_dir,) = (tmp_path / "outputs").iterdir()
    records = [json.loads((run_dir / f"cmdline_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["default_root_dir"] for r in records] == [str(run_dir)] * 2


FAIL_RANK_1 = ("+callbacks.fail._target_=tests.probes.FailAtStartOnRank", "+callbacks.fail.rank=1")


def test_a_rank_failing_at_start_up_fails_the_run_within_60_seconds(tmp_path):
    start = time.monotonic()
    process = train("strategy=ddp", *SHORT, *FAIL_RANK_1, f"hydra.run.dir={tmp_path}")
    assert time.monotonic() - start < 60
    assert process.returncode != 0
    assert "injected start-up failure on local rank 1" in process.stderr


def test_in_a_sweep_the_failing_job_is_reported_and_the_others_run(tmp_path):
    process = train("-m", "strategy=ddp", *SHORT, *PROBE, "+callbacks.fail._target_=tests.probes.FailAtStartOnRank",
                    "+callbacks.fail.rank=1,7", cwd=tmp_path)
    assert process.returncode != 0
    assert "job 0 (strategy=ddp" in process.stderr and "exited with code" in process.stderr
    (sweep_dir,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    assert not (sweep_dir / "0" / "metrics.json").exists()
    assert json.loads((sweep_dir / "1" / "metrics.json").read_text())["global_step"] == 4
    # No rank ran the sweep again: each got the job's own overrides and directory.
    records = sorted((sweep_dir / "1").glob("cmdline_rank*.json"))
    assert len(records) == 2
    for record_path in records:
        record = json.loads(record_path.read_text())
        cmdline = record["cmdline"]
        assert "-m" not in cmdline and "--multirun" not in cmdline, cmdline
        assert not any("," in part for part in cmdline[1:]), cmdline  # no comma list: the job's own override only
        assert record["default_root_dir"] == str(record_path.parent)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]  # no rank made a sweep of its own


def test_three_one_process_jobs_run_back_to_back_in_the_sweeps_interpreter(tmp_path, deepspeed_ops):
    process = train("-m", "strategy=ddp,fsdp,deepspeed_stage_2", "trainer.devices=1", "trainer.max_steps=3", "test=false",
                    *PROBE, cwd=tmp_path)
    assert process.returncode == 0, process.stderr[-4000:]
    (sweep_dir,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    records = [json.loads((job / "cmdline_rank0.json").read_text()) for job in job_dirs(sweep_dir)]
    assert len(records) == 3
    # Hydra's basic launcher ran all three in one interpreter: the sweep's own, started with -m.
    assert len({r["pid"] for r in records}) == 1 and "-m" in records[0]["cmdline"]
    assert len({r["master_port"] for r in records}) == 3  # a fresh port each time, after the last group was destroyed
    for job in job_dirs(sweep_dir):
        assert json.loads((job / "metrics.json").read_text())["global_step"] == 3
