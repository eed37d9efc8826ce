"""The layout of a pipeline-parallel axis, as data (no torch): which stages each pipeline rank holds, which blocks
each stage runs, and what a schedule asks of its microbatches. The command line refuses an impossible layout with
this before anything loads torch; the strategy builds its stages from it.

A schedule places its stages on the ranks in one of two styles (torch's `generate_stage_to_rank_mapping`): "loop"
deals stages out round-robin (rank r holds r, r + pp, ...), "v" folds them back (rank r holds r and 2 pp - 1 - r), so
that the first and the last stage share a rank.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Schedule:
    """What lightning_dist needs to know of one of torch's schedules."""

    multi_stage: bool  # takes a list of stages per rank (PipelineScheduleMulti) rather than one
    style: str = "loop"  # how stages are placed on ranks: "loop" or "v"
    stages_per_rank: int | None = None  # the number it requires, or None: any (1 for a single-stage schedule)
    microbatches_at_least_stages: bool = False  # it refuses fewer microbatches than stages
    microbatches_in_rounds: bool = False  # interleaved: the microbatches divide into rounds of pp
    zero_bubble: bool = False  # splits backward into input and weight gradients, filling the bubble with the latter


# Every schedule torch ships (`torch.distributed.pipelining.schedules.get_schedule_class`), by its name there.
SCHEDULES: dict[str, Schedule] = {
    "GPipe": Schedule(multi_stage=False, stages_per_rank=1),
    "1F1B": Schedule(multi_stage=False, stages_per_rank=1, microbatches_at_least_stages=True),
    "Interleaved1F1B": Schedule(multi_stage=True, microbatches_in_rounds=True),
    "LoopedBFS": Schedule(multi_stage=True),
    "InterleavedZeroBubble": Schedule(multi_stage=True, microbatches_in_rounds=True, zero_bubble=True),
    "ZBVZeroBubble": Schedule(multi_stage=True, style="v", stages_per_rank=2, zero_bubble=True),
    "DualPipeV": Schedule(multi_stage=True, style="v", stages_per_rank=2, microbatches_at_least_stages=True,
                          zero_bubble=True),
}
# A schedule written as a CSV file (torch's `PipelineScheduleMulti._load_csv`): one row of actions per rank.
CSV_SCHEDULE = Schedule(multi_stage=True)


def schedule_named(name: str) -> Schedule:
    """The schedule called `name` (any case), a CSV file's, or ValueError naming the choices."""
    if str(name).endswith(".csv"):
        return CSV_SCHEDULE
    by_lower = {known.lower(): schedule for known, schedule in SCHEDULES.items()}
    if str(name).lower() not in by_lower:
        raise ValueError(f"strategy.pipeline_schedule={name!r}: choose one of {', '.join(SCHEDULES)},"
                         " or a schedule's .csv file")
    return by_lower[str(name).lower()]


def canonical_schedule_name(name: str) -> str:
    """`name` as torch spells it (a CSV file's path as it is)."""
    return next((known for known in SCHEDULES if known.lower() == str(name).lower()), str(name))


@dataclass(frozen=True)
class PipelineLayout:
    """`pp` ranks holding `stages_per_rank` stages each of a model with `blocks` blocks, run by `schedule`."""

    pp: int
    stages_per_rank: int
    blocks: int
    schedule: str = "1F1B"

    @property
    def stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def style(self) -> str:
        return schedule_named(self.schedule).style

    def stages_of_rank(self, pp_rank: int) -> list[int]:
        """The stage indices pipeline rank `pp_rank` holds, in order."""
        if self.style == "v":
            return sorted({pp_rank, 2 * self.pp - 1 - pp_rank}) if self.stages_per_rank == 2 else [pp_rank]
        return [pp_rank + k * self.pp for k in range(self.stages_per_rank)]

    def rank_of_stage(self, stage: int) -> int:
        return next(rank for rank in range(self.pp) if stage in self.stages_of_rank(rank))

    def blocks_of_stage(self, stage: int) -> range:
        """The contiguous blocks stage `stage` runs: an equal share of them."""
        per_stage = self.blocks // self.stages
        return range(stage * per_stage, (stage + 1) * per_stage)

    def bubble_fraction(self, microbatches: int) -> float:
        """The share of a step a rank idles in the schedule's fill and drain, as the schedules' papers state it:
        (pp - 1) / (m + pp - 1) for GPipe and 1F1B, divided by the stages per rank for interleaved ones; a
        zero-bubble schedule fills it with weight gradients (its ideal is 0)."""
        schedule = schedule_named(self.schedule)
        if schedule.zero_bubble:
            return 0.0
        idle = (self.pp - 1) / self.stages_per_rank
        return idle / (microbatches + idle)

    def in_flight(self, microbatches: int, stage: int) -> int:
        """Microbatches whose activations a stage holds at once: GPipe keeps all of them until backward, 1F1B and
        its kin at most as many as the stages after it, counting itself."""
        if self.schedule.lower() in ("gpipe", "loopedbfs"):
            return microbatches
        return min(microbatches, self.stages - stage)


def check_pipeline(pp: int, stages_per_rank: int, schedule: str, microbatches: int, blocks: int | None,
                   batch_size: int | None) -> PipelineLayout:
    """The layout, or ValueError in one line naming the key and what it must be: the blocks divide into stages, the
    schedule's stage count and microbatch count suit it, and the batch divides into microbatches."""
    kind = schedule_named(schedule)
    for key, value in (("strategy.pipeline_parallel_size", pp), ("strategy.stages_per_rank", stages_per_rank),
                       ("strategy.microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}={value!r}: must be an integer >= 1")
    name = canonical_schedule_name(schedule)
    if kind.stages_per_rank is not None and stages_per_rank != kind.stages_per_rank:
        hint = "" if kind.multi_stage else "; Interleaved1F1B, LoopedBFS or ZBVZeroBubble run several"
        raise ValueError(f"strategy.stages_per_rank={stages_per_rank}: {name} runs exactly {kind.stages_per_rank}"
                         f" stage(s) per rank{hint}")
    layout = PipelineLayout(pp, stages_per_rank, blocks or 0, name)
    if kind.microbatches_at_least_stages and microbatches < layout.stages:
        raise ValueError(f"strategy.microbatches={microbatches}: {name} needs at least one per stage, here"
                         f" {layout.stages} (pipeline_parallel_size x stages_per_rank)")
    if kind.microbatches_in_rounds and not _whole_rounds(microbatches, pp):
        choices = ", ".join(str(n) for n in range(1, 4 * pp + 1) if _whole_rounds(n, pp))
        raise ValueError(f"strategy.microbatches={microbatches}: {name} runs them in rounds of about"
                         f" pipeline_parallel_size={pp} and needs whole rounds; choose one of {choices}, ...")
    if blocks is not None and blocks % layout.stages:
        raise ValueError(f"strategy.pipeline_parallel_size={pp}: the model's {blocks} blocks do not divide into"
                         f" {layout.stages} stages (pipeline_parallel_size x stages_per_rank={stages_per_rank})")
    if batch_size is not None and batch_size % microbatches:
        raise ValueError(f"strategy.microbatches={microbatches}: data.batch_size={batch_size} (per data-parallel rank)"
                         " does not divide into them; choose a divisor of the batch")
    if kind is CSV_SCHEDULE:
        check_schedule_file(schedule, layout, microbatches)
    return layout


# One action of a schedule file in torch's compute-only format (`_Action.from_str`): stage, F (forward), B (full
# backward), I (input gradients) or W (weight gradients), microbatch; `2F0` is stage 2's forward of microbatch 0.
_ACTION = re.compile(r"(\d+)(F|B|I|W)(\d+)")


def model_unsplit(facts: Any, stages: int) -> str | None:
    """Why a model's blocks cannot be split into `stages` pipeline stages of equal depth (one a rank: auto_fit's
    fsdp_pp), read from its facts (memory/model_facts.py), or None."""
    if not facts.blocks or facts.blocks % stages:
        return f"the model's {facts.blocks} blocks do not divide into {stages} pipeline stages"
    return None


def activations_held(activations: float, pp: int, layout: Any) -> float:
    """What one of `pp` stages saves of a step's `activations` (the memory planner's): its share of the layers'
    activations, for the microbatches in flight through it (`layout.pipeline_in_flight`)."""
    return activations / pp * layout.pipeline_in_flight


def check_schedule_file(path: str, layout: PipelineLayout, microbatches: int) -> None:
    """ValueError in one line unless the CSV file at `path` is a schedule torch can run for `layout`: one row of
    actions per pipeline rank, each action of one of its stages and microbatches, and every stage's forward of every
    microbatch in it. torch reads it only when the ranks have started and built their stages."""
    key = f"strategy.pipeline_schedule={path}"
    try:
        with open(path, newline="") as file:
            rows = list(csv.reader(file))
    except OSError as error:
        raise ValueError(f"{key}: cannot be read ({error.strerror or error}); pass a schedule's .csv file (one row"
                         " of actions per pipeline rank) or a schedule's name") from None
    if len(rows) != layout.pp:
        raise ValueError(f"{key}: holds {len(rows)} row(s) of actions, one per pipeline rank is needed:"
                         f" strategy.pipeline_parallel_size={layout.pp}")
    forwards = set()
    for rank, row in enumerate(rows):
        for cell in (cell.strip() for cell in row):
            if not cell:
                continue
            if not (match := _ACTION.fullmatch(cell)):
                raise ValueError(f"{key}: row {rank + 1} holds {cell!r}, not an action (stage, F, B, I or W,"
                                 " microbatch: e.g. 0F0, 1B3)")
            stage, action, microbatch = int(match[1]), match[2], int(match[3])
            if stage >= layout.stages or microbatch >= microbatches:
                raise ValueError(f"{key}: row {rank + 1} holds {cell}, of stage {stage} and microbatch {microbatch};"
                                 f" this layout has stages 0-{layout.stages - 1} (pipeline_parallel_size x"
                                 f" stages_per_rank) and microbatches 0-{microbatches - 1} (strategy.microbatches)")
            if action == "F":
                forwards.add((stage, microbatch))
    if missing := sorted({(s, m) for s in range(layout.stages) for m in range(microbatches)} - forwards):
        stage, microbatch = missing[0]
        raise ValueError(f"{key}: no row runs {stage}F{microbatch} (stage {stage}'s forward of microbatch"
                         f" {microbatch}); {len(missing)} forward(s) are missing")


def _whole_rounds(microbatches: int, pp: int) -> bool:
    """torch's condition for an interleaved schedule: the microbatches split into max(1, m // pp) equal rounds."""
    return microbatches % max(1, microbatches // pp) == 0


DRY_RUN_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS")


def dry_run_refusal(schedule: str) -> str | None:
    """Why the dry run cannot replay `schedule` (strategies/torch/pipeline_replay.py), or None."""
    if schedule in DRY_RUN_SCHEDULES:
        return None
    return (f"strategy.pipeline_schedule={schedule} is not dry-run (zero-bubble and file schedules split backward"
            f" in passes the dry run does not replay); {', '.join(DRY_RUN_SCHEDULES)} are")
