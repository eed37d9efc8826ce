"""No host reads in a training step that neither logs, refreshes the bar, validates nor saves, under every preset:
counted by `callbacks=[default,host_syncs]` (lightning_dist/callbacks/host_syncs.py) in the acceptance runs of
`train.py` (2 ranks, 20 steps, `log_every_n_steps=5`, the default callbacks), and on plain Lightning with our
callbacks. On a GPU each read would make the host wait for the device, every step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import TQDMProgressBar

from lightning_dist.callbacks import HostSyncs, RunSummary, StepProgressBar, TrainingMonitor
from lightning_dist.data.pydoc_text import PydocTextDataModule
from lightning_dist.models.gpt import GPTLanguageModel
from tests.conftest import STRATEGY_NAMES, extended_run, in_the_suite, run_train

pytestmark = pytest.mark.slow

# What the engines read on the host by design, named by function, and when. Anything else in a quiet step fails.
# - ZeRO-3 records the order its modules run in over its first two steps, then checks that every rank recorded the
#   same (deepspeed.runtime.zero.utils.assert_ints_same_as_other_ranks, one read per module): once per run.
# - With the optimizer offloaded, its step runs on the host, which waits for the gradients anyway; DeepSpeed reads
#   each gradient's norm there (complete_grad_norm_calculation_for_cpu_offload) as they arrive.
# - Pipeline stages: torch's schedule infers each stage's shapes in its first step, sending them as objects.
WARM_UP_READS = {  # name: (where, the steps before which it reads)
    "deepspeed_stage_3": ("deepspeed.runtime.zero.utils:", 3),  # recorded in step 1, checked at the end of step 2
    "deepspeed_stage_3_offload": ("deepspeed.runtime.zero.utils:", 3),
    "fsdp_pp": ("lightning_dist.strategies.torch.pipeline:run:", 1),
    "fsdp_tp_pp": ("lightning_dist.strategies.torch.pipeline:run:", 1),
}
OFFLOAD_READS = {
    "deepspeed_stage_2_offload": "deepspeed.runtime.zero.stage_1_and_2:complete_grad_norm_calculation_for_cpu_offload:",
    "deepspeed_stage_3_offload": "deepspeed.runtime.zero.stage3:complete_grad_norm_calculation_for_cpu_offload:",
}
EXTRA_RUNS = {  # presets the acceptance runs leave out, and the precision a GPU run trains in
    "fsdp_tp": ("strategy=fsdp_tp",),
    "hsdp_tp": ("strategy=hsdp_tp", "trainer.devices=4", "strategy.data_parallel_replicate_size=2"),
    "deepspeed_stage_2 bf16-mixed": ("strategy=deepspeed_stage_2", "trainer.precision=bf16-mixed"),
    "fsdp_pp": ("strategy=fsdp_pp",),  # 2 stages
    "fsdp_tp_pp": ("strategy=fsdp_tp_pp", "trainer.devices=4"),  # 2 stages x 2 tensor-parallel ranks
    "fsdp cp 2": ("strategy=fsdp", "strategy.context_parallel_size=2"),
}
# fsdp_tp's steps are hsdp_tp's tensor-parallel half, and fsdp_tp_pp's are hsdp_tp's and fsdp_pp's together (a 4-rank
# run, 50 s of a loaded suite): the suite counts the parts, the extended matrix all.
EXTRA_IN_THE_SUITE = [name for name in EXTRA_RUNS if name not in ("fsdp_tp", "fsdp_tp_pp")]


def host_syncs_per_rank(run_dir: Path) -> list[dict]:
    files = sorted(run_dir.glob("host_syncs*.json"))
    assert files, f"no host_syncs.json in {run_dir}"
    return [json.loads(path.read_text()) for path in files]


def unexplained(name: str, report: dict) -> list[dict]:
    """The reads of `report`'s quiet steps that no engine makes by design."""
    quiet = set(report["quiet_steps"])
    found = []
    for sync in report["syncs"]:
        if sync["step"] not in quiet:
            continue
        if name in OFFLOAD_READS and sync["where"].startswith(OFFLOAD_READS[name]):
            continue
        where, before = WARM_UP_READS.get(name, ("", 0))
        if sync["step"] < before and sync["where"].startswith(where):
            continue
        found.append(sync)
    return found


@pytest.fixture(scope="module")
def extra_runs(request, tmp_path_factory, deepspeed_ops):
    runs = {}
    for name in EXTRA_RUNS if extended_run(request.config) else EXTRA_IN_THE_SUITE:
        overrides = EXTRA_RUNS[name]
        run = run_train(tmp_path_factory.mktemp("host_syncs"), "trainer.devices=2", *overrides, "trainer.max_steps=12",
                        "test=false", "callbacks=[default,host_syncs]", "data.batch_size=4")  # as the acceptance runs
        assert run.process.returncode == 0, run.output[-3000:]
        runs[name] = run
    return runs


def test_no_host_reads_in_quiet_steps_of_the_acceptance_runs(strategy_run):
    name, run = strategy_run
    assert run.process.returncode == 0, run.output[-3000:]
    reports = host_syncs_per_rank(run.run_dir)
    assert len(reports) == 2
    for report in reports:
        # 20 steps, logged every 5th: 16 quiet steps, less validation's and the last (which refreshes the bar).
        assert len(report["quiet_steps"]) >= 14, report["steps"]
        assert unexplained(name, report) == []
        # The counter sees the reads where they belong: the loggers' writes read the logged values on the host.
        logging_steps = [int(step) for step, events in report["steps"].items() if events["logs"]]
        assert any(sync["step"] in logging_steps and sync["source"] == "Lightning" for sync in report["syncs"])


@pytest.mark.parametrize("name", in_the_suite(list(EXTRA_RUNS), EXTRA_IN_THE_SUITE))
def test_no_host_reads_in_quiet_steps_of_the_other_presets(extra_runs, name):
    reports = host_syncs_per_rank(extra_runs[name].run_dir)
    assert len(reports) == (4 if name in ("hsdp_tp", "fsdp_tp_pp") else 2)
    for report in reports:
        assert len(report["quiet_steps"]) >= 8, report["steps"]
        assert unexplained(name.split()[0], report) == []


def test_every_preset_is_counted():
    assert set(STRATEGY_NAMES) | set(EXTRA_RUNS) >= {
        p.stem for p in (Path(__file__).parents[2] / "conf" / "strategy").glob("*.yaml")
    } - {"deepspeed", "auto_fit", "deepspeed_stage_3_offload_nvme"}  # NVMe's: tests/strategies/test_nvme_offload.py


class ReadsEveryStep(L.Callback):
    """A callback that reads the loss on the host after every batch, as a careless one would."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        float(outputs["loss"])


def plain_lightning_run(tmp_path: Path, *callbacks: L.Callback, strategy: Any = "auto") -> HostSyncs:
    """Our callbacks on a plain Lightning Trainer (its own single-device strategy unless given), 12 steps, logging
    every 5."""
    torch.manual_seed(0)
    counter = HostSyncs()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=12, log_every_n_steps=5, limit_val_batches=0,
                        strategy=strategy,
                        logger=False, enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[*callbacks, counter])
    trainer.fit(GPTLanguageModel(), datamodule=PydocTextDataModule(batch_size=4))
    return counter


def test_plain_lightning_with_our_callbacks_reads_nothing_in_quiet_steps(tmp_path):
    counter = plain_lightning_run(tmp_path, StepProgressBar(refresh_rate=5), TrainingMonitor(),
                                  RunSummary(tmp_path / "metrics.json"))
    quiet = counter.per_quiet_step()
    assert len(quiet) == 9 and all(syncs == [] for syncs in quiet.values()), quiet
    # The loss was read where the bar drew it: at its refreshes (every 5th step and the last), and as training ended.
    assert {sync.step for sync in counter.syncs if "convert_tensors_to_scalars" in sync.where} == {4, 9, 11, 12}
    assert len(counter.steps) == 12


@pytest.mark.parametrize("strategy", ["ld_ddp", "ld_fsdp", "ld_deepspeed_stage_2"])
def test_our_strategies_read_nothing_in_quiet_steps_under_lightnings_own_bar(tmp_path, strategy, deepspeed_ops):
    """Plain Lightning, Lightning's bar (every 5 batches), our strategy: the strategy keeps the bar's values on the
    device between refreshes (Lightning's logger connector read them after every batch). The training monitor is
    there for ZeRO: without it, DeepSpeed's own test of the gradient norm reads it after every step, by design."""
    counter = plain_lightning_run(tmp_path, TQDMProgressBar(refresh_rate=5), TrainingMonitor(), strategy=strategy)
    quiet = counter.per_quiet_step()
    assert len(quiet) == 9 and all(syncs == [] for syncs in quiet.values()), quiet


def test_the_counter_names_each_read_and_its_source(tmp_path):
    """With Lightning's own bar (and a strategy of Lightning's), its logger connector reads the progress-bar values
    after every batch, and a callback that reads the loss does so every step: the counter finds both, in every
    quiet step."""
    counter = plain_lightning_run(tmp_path, TQDMProgressBar(refresh_rate=5), ReadsEveryStep())
    quiet = counter.per_quiet_step()
    assert len(quiet) == 9
    for syncs in quiet.values():
        sources = sorted((sync.kind, sync.source, sync.where.split(" <- ")[0].rsplit(":", 1)[0]) for sync in syncs)
        assert sources == [
            ("read", "Lightning", "lightning.fabric.utilities.apply_func:to_item"),
            ("read", "tests.callbacks.test_host_syncs", "tests.callbacks.test_host_syncs:on_train_batch_end"),
        ]
