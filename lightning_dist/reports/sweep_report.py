"""Compare the jobs of a Hydra multirun: a markdown table and a PNG of loss curves, throughput and peak memory.

    python -m lightning_dist.reports.sweep_report logs/train/multiruns/2026-11-22_10-00-00-000000
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from lightning_dist.reports.summary_file import curve, read_summary

REPORT_NAME = "sweep_report"


@dataclass
class Job:
    directory: Path
    overrides: list[str]
    summary: dict = field(default_factory=dict)
    val_loss: dict[int, float] = field(default_factory=dict)
    train_loss: dict[int, float] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return "global_step" in self.summary

    def metric(self, name: str) -> float | None:
        return self.summary.get("metrics", {}).get(name)

    @property
    def peak_memory_mb(self) -> float | None:
        per_rank = self.summary.get("peak_memory_per_rank") or []
        return max(rank["bytes"] for rank in per_rank) / 2**20 if per_rank else None


def read_jobs(sweep_dir: Path) -> list[Job]:
    """Every job directory of the sweep (one with `.hydra/overrides.yaml`), in job order."""
    jobs = []
    for overrides_file in sorted(
        sweep_dir.glob("*/.hydra/overrides.yaml"), key=lambda p: _job_order(p.parents[1].name)
    ):
        directory = overrides_file.parents[1]
        job = Job(directory, yaml.safe_load(overrides_file.read_text()) or [])
        job.summary = read_summary(directory)
        job.val_loss, job.train_loss = (curve(job.summary, name) for name in ("val_loss", "train_loss"))
        jobs.append(job)
    if not jobs:
        raise SystemExit(
            f"error: {sweep_dir}: no job directories (with .hydra/overrides.yaml) in it; is it a multirun directory?"
        )
    return jobs


def _job_order(name: str) -> tuple[int, str]:
    return (int(name), name) if name.isdigit() else (1 << 30, name)


def labels(jobs: list[Job]) -> list[str]:
    """Each job named by the overrides that differ between jobs (all of them if the sweep has one job)."""
    differing = {o for job in jobs for o in job.overrides if any(o not in other.overrides for other in jobs)}
    return [
        " ".join(o for o in job.overrides if o in differing) or " ".join(job.overrides) or job.directory.name
        for job in jobs
    ]


def markdown_table(jobs: list[Job]) -> str:
    header = (
        "| job | overrides | status | train loss | val loss | median step (ms) | samples/s | tokens/s | peak "
        "memory per rank (MiB) |"
    )
    lines = [header, "|" + "---|" * 9]
    for job, label in zip(jobs, labels(jobs)):
        step = job.summary.get("median_step_time_s")
        cells = [
            job.directory.name, f"`{label}`", "finished" if job.finished else "**failed**",
            _fmt(job.metric("train_loss"), ".4f"), _fmt(job.metric("val_loss"), ".4f"),
            _fmt(step * 1000 if step else None, ".1f"), _fmt(job.summary.get("samples_per_s"), ".1f"),
            _fmt(job.summary.get("tokens_per_s"), ".0f"), _fmt(job.peak_memory_mb, ".0f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def steps_done(losses: dict[int, float]) -> dict[int, float]:
    """A curve on the axis of optimizer steps done. Loggers label a value with the steps before the one that made it
    (the loss of a 50-step run's last step is at 49); the validation before training, at 0, stays there."""
    return {step + 1 if step else 0: value for step, value in losses.items()}


def plot(jobs: list[Job], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on clusters and CI
    import matplotlib.pyplot as plt

    names = labels(jobs)
    figure, axes = plt.subplots(2, 2, figsize=(13, 9))
    for index, (job, name) in enumerate(zip(jobs, names)):
        # Strategies that agree draw the same curve; line styles keep every series visible on top of the others.
        style = {"linestyle": ("-", "--", ":", "-.")[index % 4], "marker": "osd^v<>"[index % 7], "markersize": 4}
        for ax, losses in ((axes[0][0], job.val_loss), (axes[0][1], job.train_loss)):
            if losses:
                done = steps_done(losses)
                ax.plot(list(done), list(done.values()), label=name, color=f"C{index}", **style)
    last_step = max((job.summary.get("global_step") or 0 for job in jobs), default=0)
    for ax, title, ylabel in ((axes[0][0], "Validation loss", "val_loss"), (axes[0][1], "Training loss", "train_loss")):
        ax.set(title=title, xlabel="optimizer steps done", ylabel=ylabel)
        if last_step:
            ax.set_xlim(0, last_step)  # every step of the longest job, its last included
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    bars = (
        (axes[1][0], [job.summary.get("tokens_per_s") or job.summary.get("samples_per_s") or 0 for job in jobs],
         "Throughput", "tokens/s" if any(job.summary.get("tokens_per_s") for job in jobs) else "samples/s"),
        (axes[1][1], [job.peak_memory_mb or 0 for job in jobs], "Peak memory (largest rank)", "MiB"),
    )
    for ax, values, title, ylabel in bars:
        ax.bar(range(len(jobs)), values, color=[f"C{i}" for i in range(len(jobs))])
        ax.set_xticks(range(len(jobs)), names, rotation=20, ha="right", fontsize=8)
        ax.set(title=title, xlabel="job", ylabel=ylabel)
        for x, value in enumerate(values):
            ax.annotate(f"{value:,.0f}", (x, value), ha="center", va="bottom", fontsize=8)
    figure.suptitle(f"Sweep {path.parent.name}: {len(jobs)} jobs")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_report(sweep_dir: Path) -> tuple[Path, Path]:
    jobs = read_jobs(sweep_dir)
    table, image = sweep_dir / f"{REPORT_NAME}.md", sweep_dir / f"{REPORT_NAME}.png"
    plot(jobs, image)
    failed = [job.directory.name for job in jobs if not job.finished]
    note = f"\nFailed jobs (no finished run in their directory): {', '.join(failed)}\n" if failed else ""
    table.write_text(
        f"# Sweep {sweep_dir.name}\n\n{markdown_table(jobs)}{note}\n![loss, throughput and memory]({image.name})\n"
    )
    return table, image


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="a multirun directory (hydra.sweep.dir)")
    table, image = write_report(parser.parse_args(argv).sweep_dir)
    print(table.read_text())
    print(f"Wrote {table} and {image}")


if __name__ == "__main__":
    main()
