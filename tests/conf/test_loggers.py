"""logger=[csv,tensorboard,wandb,mlflow] on a 2-rank FSDP run: each logger's files, read back with its own
library, hold the training losses the CSV holds, and so does the run's own summary (metrics.json)."""

from __future__ import annotations

import json
import struct

import pytest

from lightning_dist.reports.summary_file import curve
from tests.conftest import run_train

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory, deepspeed_ops):
    run = run_train(tmp_path_factory.mktemp("loggers"), "strategy=fsdp", "logger=[csv,tensorboard,wandb,mlflow]",
                    "trainer.max_steps=6", "trainer.log_every_n_steps=1", "test=false")
    assert run.process.returncode == 0, run.output[-3000:]
    return run


@pytest.fixture(scope="module")
def csv_losses(run) -> dict[int, float]:
    losses = {int(row["step"]): float(row["train_loss"]) for row in run.csv_rows() if row.get("train_loss")}
    assert sorted(losses) == list(range(6))
    return losses


def test_tensorboard_events(run, csv_losses):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run.run_dir / "tensorboard"))
    events.Reload()
    assert {e.step: e.value for e in events.Scalars("train_loss")} == pytest.approx(csv_losses, rel=1e-7)


def test_mlflow_store_in_the_run_directory(run, csv_losses):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run.run_dir / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "lightning-dist"]
    (mlflow_run,) = client.search_runs([experiment.experiment_id])
    history = client.get_metric_history(mlflow_run.info.run_id, "train_loss")
    assert {m.step: m.value for m in history} == pytest.approx(csv_losses, rel=1e-7)


def test_wandb_offline_run(run, csv_losses):
    (log,) = run.run_dir.glob("wandb/offline-run-*/run-*.wandb")  # offline: nothing left the machine
    rows = [row for row in wandb_history(log.read_bytes()) if "train_loss" in row]
    assert {row["trainer/global_step"]: row["train_loss"] for row in rows} == pytest.approx(csv_losses, rel=1e-7)


def test_the_summary_holds_the_same_curve_whichever_loggers_ran(run, csv_losses):
    assert curve(run.summary, "train_loss") == csv_losses


def wandb_history(data: bytes) -> list[dict]:
    """The history rows of a W&B offline transaction log: wandb's own protobuf records (`wandb_internal_pb2`),
    framed as LevelDB's log (7-byte header, 32 KiB blocks, records split FIRST/MIDDLE/LAST), which wandb's Python
    package no longer reads itself since its Go core took over the files."""
    from wandb.proto import wandb_internal_pb2

    assert data[:4] == b":W&B"
    block, position, records, pending = 32768, 7, [], b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        chunk, position = data[position + 7:position + 7 + length], position + 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind in (2, 3):
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
            pending = b""
    rows = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return rows
