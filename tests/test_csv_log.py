"""A run continued into its own directory adds to its CSV log (lightning_dist/reports/csv_log.py): the earlier rows stay,
the new ones follow, under the union of the columns."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from lightning_dist.reports.csv_log import ContinuingCSVLogger


def write_rows(path: Path, columns: list[str], rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def read(path: Path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        return list(reader.fieldnames), list(reader)


def log_and_save(tmp_path: Path, *steps: dict) -> Path:
    logger = ContinuingCSVLogger(tmp_path, name="csv", version="")
    for metrics in steps:
        logger.log_metrics({k: v for k, v in metrics.items() if k != "step"}, step=metrics["step"])
    logger.save()
    return tmp_path / "csv" / "metrics.csv"


@pytest.mark.parametrize("earlier_columns", [["step", "train_loss"], ["train_loss", "step"]], ids=["sorted", "unsorted"])
def test_the_continued_attempts_rows_follow_the_earlier_ones(tmp_path, earlier_columns):
    write_rows(tmp_path / "csv" / "metrics.csv", earlier_columns,
               [{"step": 0, "train_loss": 2.5}, {"step": 1, "train_loss": 2.25}])
    path = log_and_save(tmp_path, {"step": 2, "train_loss": 2.0}, {"step": 2, "val_loss": 1.5})
    columns, rows = read(path)
    assert columns == ["step", "train_loss", "val_loss"]
    assert [(r["step"], r["train_loss"], r["val_loss"]) for r in rows] == [
        ("0", "2.5", ""), ("1", "2.25", ""), ("2", "2.0", ""), ("2", "", "1.5")]


def test_a_first_attempt_writes_what_lightnings_logger_writes(tmp_path):
    columns, rows = read(log_and_save(tmp_path, {"step": 0, "train_loss": 2.5}))
    assert columns == ["step", "train_loss"] and rows == [{"step": "0", "train_loss": "2.5"}]
