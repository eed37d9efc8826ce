"""Lightning's whole loop on fake CUDA devices under every preset (lightning_dist/dry_run/fake_loop.py; 5 of them in
the extended checks): sanity validation, training steps, a validation with the module's torchmetrics metrics, the
test loop, and the checkpoint fit would save, resumed by a new run; every op and collective device-checked, as one
rank of the world size a preset needs.

Both failures of the first real GPU run that no CPU run could show are of this kind: metric states left on the host
under ZeRO-3 (and, found here since, under FSDP's CPU offload), and ZeRO-3's module on the host for `test` after
`fit`. With each fix undone, the loop fails naming the op, both devices and the metric."""

from __future__ import annotations

import os

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lightning_dist.dry_run import dry_run_devices
from tests.conftest import PIPELINE_PARALLEL_NAMES, PRESET_NAMES, REPO, in_the_suite
from tests.fake_loop_runs import loops_each

CONF = REPO / "lightning_dist" / "conf"
RANK = 1
# Tensor parallelism splits each layer over 2 ranks of a node, beside 2-way data parallelism; HSDP replicates over
# the nodes. Every other preset: 2 ranks on one node.
WORLDS = {"fsdp_tp": (4, 1), "hsdp_tp": (2, 2)}
# Layouts that are options rather than presets: their overrides and world (rank 1 is context-parallel rank 1).
LAYOUTS = {
    "fsdp, context_parallel_size=2": (("strategy=fsdp", "strategy.context_parallel_size=2"), (4, 1)),
    "fsdp, context_parallel_size=2, ring": (("strategy=fsdp", "strategy.context_parallel_size=2",
                                             "strategy.context_parallel=ring"), (4, 1)),
    "deepspeed_stage_3, context_parallel_size=2": (("strategy=deepspeed_stage_3", "strategy.context_parallel_size=2"),
                                                   (4, 1)),
}
# The run's own callbacks but for checkpoint files (the loop checks the checkpoint's contents instead) and the bar.
NOT_IN_THE_LOOP = ("model_checkpoint", "progress_bar")


def loop_arguments(name: str, nvme: str) -> tuple:
    """`loop_on_fake_devices`' arguments for preset `name`, composed as `train.py strategy=NAME trainer=gpu` composes
    them (bf16-mixed), at the preset's world size."""
    strategy, (devices, num_nodes) = LAYOUTS.get(name, ((f"strategy={name}",), WORLDS.get(name, (2, 1))))
    overrides = [*strategy, "trainer=gpu", f"trainer.devices={devices}", f"trainer.num_nodes={num_nodes}",
                 f"paths.output_dir={nvme}", *([f"strategy.nvme_path={nvme}"] if name.endswith("_nvme") else [])]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    plain = lambda node: OmegaConf.to_container(node, resolve=True)  # noqa: E731
    model = plain(cfg.model)
    model.pop("block_class", None)
    callbacks = [plain(c) for key, c in cfg.callbacks.items() if c is not None and key not in NOT_IN_THE_LOOP]
    return plain(cfg.strategy), model, plain(cfg.data), callbacks, cfg.trainer.precision, devices, num_nodes, RANK


def run_loops(names: list[str], directory, undone: str | None = None) -> dict:
    _, run, where = dry_run_devices("gpu", 4)
    assert where in ("on fake CUDA devices (this machine has none)", "on fake tensors on this machine's CUDA")
    return run(loops_each, {name: loop_arguments(name, str(directory)) for name in names}, undone)


# CI's compatibility tier (another torch, .ci/compat_tier) runs one preset of each engine and layout: what differs
# between torch releases is the engine's code, not the preset's options (tests/compat/test_runs_on_this_torch.py
# trains those there as typed), and the NVMe preset, which trains there only here (its I/O op is not built for the
# tier's torch).
TIER_PRESETS = ["ddp", "deepspeed_stage_2_offload", "deepspeed_stage_3", "deepspeed_stage_3_offload_nvme", "fsdp",
                "fsdp_cpu_offload", "fsdp_tp"]
# Pipeline stages are not replayed on fake devices yet (the dry run refuses them in one line); they train for real in
# tests/strategies/test_pipeline_parallel.py and on the tier's torch in tests/compat/test_runs_on_this_torch.py.
# The main suite: the tier's presets and HSDP (2 nodes). The others (ZeRO-1, ZeRO-2, ZeRO-3's offload without NVMe,
# FSDP's activation checkpointing and SHARD_GRAD_OP) differ from them in options, whose set-up and steps on their
# ranks' devices tests/test_dry_run_on_cuda.py checks under every preset; their whole loop is an extended check
# (18 s of the suite: the loops share one process's start).
SUITE_PRESETS = sorted([*TIER_PRESETS, "hsdp_tp"])
LOOPED = TIER_PRESETS if os.environ.get("LD_COMPAT_TIER") == "1" else SUITE_PRESETS
OTHER_PRESETS = [name for name in PRESET_NAMES if name not in [*PIPELINE_PARALLEL_NAMES, *SUITE_PRESETS]]


@pytest.fixture(scope="module")
def every_preset(tmp_path_factory):
    return run_loops(LOOPED, tmp_path_factory.mktemp("loops"))


def assert_whole_loops_on_their_devices(reports: dict) -> None:
    failed = {name: report for name, report in reports.items() if isinstance(report, str)}
    assert failed == {}
    for name, report in reports.items():
        assert report.device == f"cuda:{RANK % WORLDS.get(name, (2, 1))[0]}", name
        # fit: the sanity check, 2 steps and a validation; test; the resumed run: 1 step and a validation
        assert report.stages == ["sanity check", "train", "validation", "test", "train", "validation"], name
        assert (report.resumed_from_step, report.steps) == (2, 3), name
        assert {"train_loss", "val_loss", "val_ppl", "test_loss", "test_ppl"} <= set(report.logged), name
        # buffers, metric states and (while fitting) optimizer state where they are used, at every stage
        assert report.misplaced == {}, name


@pytest.mark.compat
def test_every_preset_runs_lightning_s_whole_loop_on_its_rank_s_device(every_preset):
    assert sorted(every_preset) == LOOPED
    assert_whole_loops_on_their_devices(every_preset)


@pytest.mark.extended
def test_the_other_presets_run_lightning_s_whole_loop_on_their_rank_s_device(tmp_path):
    assert len(OTHER_PRESETS) == 5, OTHER_PRESETS
    assert_whole_loops_on_their_devices(run_loops(OTHER_PRESETS, tmp_path))


@pytest.mark.compat
def test_the_saved_state_is_on_the_rank_s_device_or_the_host(every_preset):
    for name, report in every_preset.items():
        own = {"cpu", report.device}
        assert report.saved and all(set(devices) <= own for devices in report.saved.values()), (name, report.saved)
    # DDP saves the module's state as its rank holds it; FSDP gathers it whole on the host
    assert every_preset["ddp"].saved["state_dict"] == [every_preset["ddp"].device]
    assert every_preset["fsdp"].saved["state_dict"] == ["cpu"]


# In the suite: the GPU run's failure (ZeRO-3's metric states); the two found since, with the whole matrix
# (scripts/extended_checks.sh).
UNDONE = [
    ("deepspeed_metric_states", "deepspeed_stage_3",
     "DeviceMismatch: rank 1: aten.add_.Tensor was given tensors on cuda:1 and cpu; a GPU run fails here the same way"
     " (in the metric val_loss, a MeanMetric: mean_value on cpu, weight on cpu)"),
    ("fsdp_offload_metric_states", "fsdp_cpu_offload",
     "DeviceMismatch: rank 1: aten.add_.Tensor was given tensors on cuda:1 and cpu; a GPU run fails here the same way"
     " (in the metric val_loss, a MeanMetric: mean_value on cpu, weight on cpu)"),
    ("deepspeed_test_after_fit", "deepspeed_stage_3",
     "DeviceMismatch: rank 1: aten.embedding.default was given tensors on cpu and cuda:1; a GPU run fails here the"
     " same way"),
]


@pytest.mark.parametrize(("undone", "preset", "message"), in_the_suite(UNDONE, UNDONE[:1], unpack=True))
def test_each_fix_undone_fails_naming_the_op_both_devices_and_the_metric(tmp_path, undone, preset, message):
    (report,) = run_loops([preset], tmp_path, undone).values()
    assert isinstance(report, str) and report.splitlines()[0] == message, report[-3000:]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallelism_runs_lightning_s_whole_loop_on_its_rank_s_device(tmp_path, name):
    """Each step on the rank's shard of the sequences, attention exchanged across the 2 context-parallel ranks (by
    torch's all-to-all under FSDP, DeepSpeed's `DistributedAttention` under ZeRO, torch's ring attention on CUDA's
    flash kernel) and what is logged averaged over them, every op and collective on the rank's own device."""
    (report,) = run_loops([name], tmp_path).values()
    assert not isinstance(report, str), report[-3000:]
    assert report.device == "cuda:1"
    assert report.stages == ["sanity check", "train", "validation", "test", "train", "validation"]
    assert {"train_loss", "val_loss", "val_ppl", "test_loss", "test_ppl"} <= set(report.logged)
    assert report.misplaced == {}
