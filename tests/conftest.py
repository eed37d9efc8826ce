"""Shared helpers: real training runs in subprocesses (each spawns 2 ranks), composed configs, DeepSpeed ops."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# The environment the suite was started with, before any import of ours or torch's: what a user's shell gives a run.
# The runs get it, and the warm Python starts from it. torch._dynamo's import adds TORCHINDUCTOR_CACHE_DIR to the
# environment of the process importing it; captured after the suite's own imports had done so, the runs' environment
# lacked a variable the warm Python had, and every run of a whole suite started cold (a CI run of 77 minutes).
# One exception, set before torch loads (OpenMP reads it then), for this process and every one the suite starts:
# OpenMP threads waiting at the end of a parallel region sleep instead of spinning (libgomp spins by default). The
# suite runs 2 workers, each starting ranks, on 2 cores, and a spinning thread holds a core its sibling needs: a
# one-rank run (2 intra-op threads) took 1.55 s a step beside a loaded suite, 0.18 s with this (2026-12-03).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
TRAIN_ENV = dict(os.environ)  # no warning filters: the tests see the console a user sees

import pytest  # noqa: E402

from lightning_dist.lifecycle.op_builds import keep_op_cache_in_this_environment  # noqa: E402
from tests import warm_python  # noqa: E402

# DeepSpeed's ops compile into this venv's own cache, as every run in it chooses by itself: said once here, for this
# process and every run. Set by the first test that loads an op instead, it was undone by the environment each
# later module restores, and a test then read the cache of the machine's other venv (~/.cache), whose build files
# name that venv's include paths: its copy of the op compiled again, 4 minutes.
if (op_cache := keep_op_cache_in_this_environment()) is not None:
    TRAIN_ENV["TORCH_EXTENSIONS_DIR"] = str(op_cache)

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"
# Not presets: `deepspeed` (the base the presets extend, and the way in for a config file) and `auto_fit` (which
# chooses a preset once the model is known).
PRESET_NAMES = sorted(p.stem for p in (CONF_DIR / "strategy").glob("*.yaml") if p.stem not in ("deepspeed", "auto_fit"))
# Tensor parallelism composes with data parallelism from 4 ranks on, and its data-parallel size is not ddp's on the
# same ranks: its presets have their own tests (tests/strategies/test_tensor_parallel.py).
TENSOR_PARALLEL_NAMES = ["fsdp_tp", "hsdp_tp"]
# Pipeline stages likewise (tests/strategies/test_pipeline_parallel.py): fsdp_tp_pp needs 8 ranks.
PIPELINE_PARALLEL_NAMES = ["fsdp_pp", "fsdp_tp_pp"]
# The NVMe preset needs a directory on a drive; it has its own tests (tests/strategies/test_nvme_offload.py).
STRATEGY_NAMES = [name for name in PRESET_NAMES if not name.endswith("_nvme")
                  and name not in TENSOR_PARALLEL_NAMES + PIPELINE_PARALLEL_NAMES]


def in_the_suite(cases: list, kept: list | tuple, unpack: bool = False) -> list:
    """`cases` for `parametrize`, those not in `kept` marked `extended`: the suite runs one case per engine and
    checkpoint format, the whole matrix runs in `bash scripts/extended_checks.sh` (`-m extended`). Each case is a
    real training run, and the whole matrix of every module took CI past its hour on our slower machines. `unpack`:
    each case is a tuple of several parameters' values."""
    unknown = [case for case in kept if case not in cases]
    assert not unknown, f"kept cases that are not cases: {unknown}"
    return [case if case in kept else pytest.param(*(case if unpack else (case,)), marks=pytest.mark.extended)
            for case in cases]


# Real DeepSpeed configs copied unchanged from public projects (their sources: tests/strategies/deepspeed/config/configs/README.md).
DS_CONFIGS = REPO / "tests" / "strategies" / "deepspeed" / "config" / "configs"
HF_ZERO2 = DS_CONFIGS / "transformers_ds_config_zero2.json"
HF_ZERO3 = DS_CONFIGS / "transformers_ds_config_zero3.json"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def one_rank_world():
    """This process as the only rank of a gloo process group: collectives run, with no one to wait for."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def cpu_has_fp16() -> bool:
    """Whether DeepSpeed's CPU accelerator trains in fp16 here (AVX512-FP16/AMX-FP16): some cells of the precision
    matrix and some config files train on such a CPU and are refused, with that reason, on others."""
    from lightning_dist.parallel.precision import fp16_supported

    return fp16_supported("cpu")


def cpu_has_bf16() -> bool:
    """Whether this CPU computes in bf16 itself (AVX512-BF16 or AMX-BF16); elsewhere torch converts to float32 and
    back, which rounds otherwise: a bf16 run's losses land a little further from a float32 run's."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "avx512_bf16" in flags or "amx_bf16" in flags


def libaio_missing() -> bool:
    """Whether DeepSpeed's async_io op (NVMe offload) cannot be built here for want of libaio's headers."""
    from deepspeed.accelerator import get_accelerator

    return not get_accelerator().create_op_builder("AsyncIOBuilder").is_compatible(verbose=False)


# Tests of NVMe offload skip on a machine without libaio, saying what to install; CI (.ci/run sets
# LD_TESTS_REQUIRE_LIBAIO=1) installs it and runs them, so there a missing libaio fails them instead.
needs_libaio = pytest.mark.skipif(
    os.environ.get("LD_TESTS_REQUIRE_LIBAIO") != "1" and libaio_missing(),
    reason="needs libaio's headers for DeepSpeed's NVMe offload: apt-get install libaio-dev",
)


@pytest.hookimpl(tryfirst=True)  # the header's last line (pytest writes the lines of hooks called first last)
def pytest_report_header(config) -> str:
    """The free disk, first in CI's log: a disk that fills mid-run fails every later test at its set-up (tmp_path),
    the tier's venvs (11 GB) being made meanwhile."""
    import shutil
    import tempfile

    return f"disk: {shutil.disk_usage(tempfile.gettempdir()).free / 2**30:.1f} GiB free for the tests' directories"


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's: the GPU suite runs without it (scripts/gpu_check.sh)
def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker per core, up to 4. A training run keeps about 1.2 of 2 cores busy (its ranks wait on
    each other and on start-up), so two workers on our 2-core machines finish the suite in about 0.6 of the time
    one takes; past 4, the group of modules sharing session runs is the longest part anyway."""
    return max(1, min(os.cpu_count() or 1, 4))


# Session fixtures whose runs many modules read, each with the group of modules that read it: a group runs in one
# worker, so each run is made once. (No module reads both.)
SHARED_RUN_GROUPS = {"trained_runs": "trained-runs", "strategy_run": "trained-runs", "curve_runs": "curve-runs"}
# Modules whose runs hold gigabytes per rank (a 400M-parameter model): in one group, so never two of them at once.
MEMORY_HEAVY = {"tests.parallel.test_sharded_init": "memory-heavy", "tests.memory.test_beyond_memory": "memory-heavy",
                "tests.models.test_pretrained_memory": "memory-heavy"}


# The groups that take longest, handed to the workers first, longest first (a clean run's seconds on our 2-core
# machines, 2026-12-03, each 60 s or more; the rest follow as xdist orders them). xdist hands groups out by how many
# tests they hold, most first: modules of a few long tests (a recipe's runs, an op's first build, the notebooks) then
# started last, while the other worker sat idle (15 minutes of a clean CI run of 9d21a3d, 5 of 0737d55's).
LONGEST_FIRST = (
    # async_io's first build (654 s of one worker in a clean run on the slow kind, 306 on the other): first, so that
    # the other worker trains meanwhile and the NVMe runs, which load the op, find it built when their turn comes.
    "tests.strategies.deepspeed.config.test_preflight",
    "trained-runs",  # 960 s
    "curve-runs",  # 753
    "tests.test_documented_commands",  # 513
    "tests.models.test_finetune_runs",  # 464
    "tests.strategies.test_pipeline_parallel",  # 292
    "tests.strategies.test_context_parallel",  # 281
    "tests.strategies.test_nvme_offload",  # 275, most of it waiting on that build
    "memory-heavy",  # 264
    "tests.recipes.test_long_context",  # 260
    "tests.run.test_two_nodes",  # 234
    "tests.test_notebooks",  # 215
    "tests.callbacks.test_model_checkpoint",  # 189
    "tests.strategies.deepspeed.config.test_deepspeed_config_runs",  # 167
    "tests.test_loop_on_cuda",  # 152
    "tests.test_dry_run_on_cuda",  # 137
    "tests.test_gpu_compare",  # 130
    "tests.test_config_errors",  # 120
    "tests.test_installed_package",  # 113
    "tests.recipes.test_finetune",  # 98
    "tests.strategies.test_plain_trainer",  # 93
    "tests.conf.test_configs",  # 91
    "tests.test_dry_run",  # 90
    "tests.run.test_kubernetes",  # 86
    "tests.models.test_gpt_moe",  # 77
    "tests.strategies.test_pipeline_dry_run",  # 72
    "tests.parallel.test_hung_collective",  # 69
    "tests.checkpoints.test_resume",  # 61
    "tests.recipes.test_hf_causal_lm",  # 61
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from collections import OrderedDict

    from xdist.scheduler import LoadGroupScheduling

    class LongestFirst(LoadGroupScheduling):
        _ordered = False

        def _assign_work_unit(self, node):
            if not self._ordered:  # the queue is whole by the first assignment; sorted is stable: the rest as xdist had it
                rank = {name: place for place, name in enumerate(LONGEST_FIRST)}
                self.workqueue = OrderedDict(sorted(self.workqueue.items(), key=lambda unit: rank.get(unit[0], len(rank))))
                self._ordered = True
            super()._assign_work_unit(node)

    return LongestFirst(config, log)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    """GPU tests leave the run where fewer CUDA devices are visible than they need (`gpu(devices=N)`, 1 unless
    said): deselected, so they never count as passed; so do the extended matrix's (`in_the_suite`) unless asked for
    with `-m extended`. The rest are grouped for pytest-xdist (`--dist loadgroup`): a module stays in one worker
    (its module fixtures are made once) unless its tests share nothing, and the modules reading one kind of shared
    session run form one group."""
    import torch

    marked_unseen = sorted({str(item.path.relative_to(REPO)) for item in items if item.get_closest_marker("compat")
                            and "mark.compat" not in item.path.read_text()})
    if marked_unseen:  # .ci/compat_tier passes pytest the files whose text has the mark
        pytest.exit(f"{', '.join(marked_unseen)}: tests marked compat where the file does not say `mark.compat`;"
                    " the compatibility tier would not run them", returncode=4)
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    unrunnable = [item for item in items
                  if (marker := item.get_closest_marker("gpu")) and marker.kwargs.get("devices", 1) > visible]
    if not extended_run(config):  # scripts/extended_checks.sh asks for them by name
        unrunnable += [item for item in items if item.get_closest_marker("extended")]
    if unrunnable:
        config.hook.pytest_deselected(items=unrunnable)
        items[:] = [item for item in items if item not in unrunnable]
    if not config.pluginmanager.has_plugin("xdist"):  # one process (the GPU suite runs so): nothing to group
        return
    groups = {**MEMORY_HEAVY, **{item.module.__name__: SHARED_RUN_GROUPS[name] for item in items
                                 for name in item.fixturenames if name in SHARED_RUN_GROUPS}}
    for item in items:
        module = item.module.__name__
        # A module whose tests share nothing (`TESTS_SHARE_NOTHING = True`) spreads them over the workers: as one
        # group, the compatibility tier's runs (320 s) kept one worker busy while the other sat idle.
        alone = getattr(item.module, "TESTS_SHARE_NOTHING", False) and module not in groups
        item.add_marker(pytest.mark.xdist_group(item.nodeid if alone else groups.get(module, module)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids) -> None:
    """Under `--dist loadgroup`, the groups must have reached the test ids, where xdist's scheduler reads them. Where
    they have not (a pytest the installed xdist cannot add them for), the suite would still pass, at twice the time:
    every shared run made once per worker, every module fixture once per chunk of its tests. Stop before any runs."""
    if node.config.getvalue("dist") == "loadgroup" and ids and not any("@" in test_id for test_id in ids):
        import xdist

        pytest.exit(f"pytest {pytest.__version__} with pytest-xdist {xdist.__version__}: --dist loadgroup left the"
                    f" groups out of the test ids ({ids[0]}), so each group would be split across workers; install"
                    " what pyproject.toml's dev extra pins (pip install -e '.[dev]'), or run in one process (-n 0)",
                    returncode=4)


@pytest.fixture(scope="session", autouse=True)
def warm_interpreter(tmp_path_factory):
    """Every Python process the suite starts, forked from one that has imported torch, DeepSpeed, Hydra and
    torchmetrics already (tests/warm_python.py): about 3 s less for each of some 400 processes. `LD_TESTS_COLD=1`
    runs the whole suite in fresh interpreters instead; a test marked `cold` always does."""
    if os.environ.get("LD_TESTS_COLD") == "1":
        yield
        return
    directory = tmp_path_factory.mktemp("warm_python")
    socket_path = str(directory / "socket")
    launcher = warm_python.write_launcher(directory / "python", socket_path)
    with open(directory / "warm.log", "w") as log:
        # In a session of its own, as each process it forks is: nothing they signal by group can reach the suite.
        server = subprocess.Popen([warm_python.REAL_PYTHON, "-m", "tests.warm_python", socket_path, str(launcher)],
                                  cwd=REPO, env=TRAIN_ENV, stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
    warm_python.wait_until_serving(server, socket_path)
    sys.executable = str(launcher)
    try:
        yield
    finally:
        sys.executable = warm_python.REAL_PYTHON
        server.terminate()
        server.wait()


@contextlib.contextmanager
def _environment_restored():
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    saved, rank = dict(os.environ), rank_zero_only.rank
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)
    rank_zero_only.rank = rank  # a strategy given another rank in this process (set_world_ranks) sets it


# Each test, and each test module (its module-scoped fixtures included), leaves the environment, and the rank that
# Lightning's rank-zero-only functions (its loggers' writes among them) read, as it found it.
# Lightning and DeepSpeed write RANK, LOCAL_RANK, WORLD_SIZE and MASTER_PORT into the process that sets them up, and
# every process a later test starts would inherit them: RANK=0 makes each task of an srun job rank zero to Lightning.
@pytest.fixture(autouse=True)
def environment_restored_per_test():
    with _environment_restored():
        yield


@pytest.fixture(scope="module", autouse=True)
def environment_restored_per_module():
    with _environment_restored():
        yield


# A plain Trainer with a distributed strategy in this process leaves its process group up (Lightning keeps it for a
# `test` after `fit`); a later module's strategy would find it and skip its own set-up. Closed per module, not per
# test: a module may share one group between its tests.
@pytest.fixture(scope="module", autouse=True)
def process_group_closed_per_module():
    yield
    from lightning_dist.lifecycle.process_exit import close_process_group

    close_process_group()


@pytest.fixture(autouse=True)
def cold_interpreter(request):
    """A test marked `cold` starts fresh interpreters: what it checks is what a fresh process imports or does."""
    if request.node.get_closest_marker("cold") is None:
        yield
        return
    warm, sys.executable = sys.executable, warm_python.REAL_PYTHON
    try:
        yield
    finally:
        sys.executable = warm


@dataclass
class TrainRun:
    """A finished `python train.py` run and what it left in its output directory."""

    process: subprocess.CompletedProcess
    run_dir: Path

    @property
    def output(self) -> str:
        return self.process.stdout + self.process.stderr

    @property
    def summary(self) -> dict:
        return json.loads((self.run_dir / "metrics.json").read_text())

    def csv_rows(self) -> list[dict[str, str]]:
        with open(self.run_dir / "csv" / "metrics.csv") as handle:
            return list(csv.DictReader(handle))

    def val_losses(self) -> dict[int, float]:
        return {int(row["step"]): float(row["val_loss"]) for row in self.csv_rows() if row.get("val_loss")}


def train_command(run_dir: Path, *overrides: str, script: Path = REPO / "train.py") -> list[str]:
    return [sys.executable, str(script), f"hydra.run.dir={run_dir}", *overrides]


# Counts what every training batch held (tests/probes.py BatchProbe), for throughput checks.
BATCH_PROBE = ("+callbacks.batch_probe._target_=tests.probes.BatchProbe", "+callbacks.batch_probe.directory=${paths.output_dir}")

def run_train(run_dir: Path, *overrides: str, timeout: float = 600, script: Path = REPO / "train.py") -> TrainRun:
    command = train_command(run_dir, *overrides, script=script)
    process = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=TRAIN_ENV)
    return TrainRun(process, run_dir)


@pytest.fixture(scope="session")
def deepspeed_ops() -> None:
    """JIT-build DeepSpeed's CPU Adam once per session (about 2 minutes when not cached in ~/.cache), as a run
    would: a build lock left by a process that ended is removed first. Its shared-memory comm op is never built
    (`_compat.deepspeed.skip_shared_memory_comm_op`)."""
    from deepspeed.accelerator import get_accelerator

    from lightning_dist.lifecycle.op_builds import announce_op_builds

    announce_op_builds(lambda line: print(line, file=sys.stderr))
    get_accelerator().create_op_builder("CPUAdamBuilder").load(verbose=False)


@pytest.fixture(scope="session")
def nvme_ops(deepspeed_ops) -> None:
    """DeepSpeed's async_io op (NVMe offload) built once, here, before a run that needs it starts: a run builds it
    itself otherwise, within its own timeout, which the build (5 minutes of both cores on a loaded machine, behind CPU
    Adam's and the compatibility tier's) then spends (CI: the beyond-memory run timed out at 900 s so)."""
    from lightning_dist.prepare import prepare

    missing = prepare("async_io")
    assert missing is None, missing


# Every acceptance run also counts its host reads per step (conf/callbacks/host_syncs.yaml: what a user adds to find
# them), which tests/callbacks/test_host_syncs.py reads. 4 sequences a rank, not the default 16: what the runs'
# readers check (host reads, dtypes, placement, schedules, falling losses) does not depend on the batch, and a step of
# the tiny GPT on the CPU is its batch's arithmetic (a 20-step ddp run: 18 CPU-s at 16, 11 at 4).
ACCEPTANCE_OVERRIDES = ("trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=20", "callbacks=[default,host_syncs]",
                        "data.batch_size=4", *BATCH_PROBE)


@pytest.fixture(scope="session")
def trained_runs(tmp_path_factory, deepspeed_ops):
    """get(strategy, *overrides) -> TrainRun, each distinct run made once per session and shared by its readers."""
    runs: dict[tuple[str, ...], TrainRun] = {}

    def get(name: str, *overrides: str) -> TrainRun:
        key = (name, *overrides)
        if key not in runs:
            runs[key] = run_train(tmp_path_factory.mktemp(name), f"strategy={name}", *ACCEPTANCE_OVERRIDES, *overrides)
        return runs[key]

    return get


@pytest.fixture(scope="session", params=STRATEGY_NAMES)
def strategy_run(request, trained_runs) -> tuple[str, TrainRun]:
    """The acceptance command of every named strategy, run once and shared by the tests that read its results."""
    return request.param, trained_runs(request.param)


# 30 steps with a checkpoint at step 15: the curve compared across strategies, and the point resumed from. The
# model is the GPT plus a frozen parameter and a buffer, and it saves its gathered weights for the checkpoint tests.
# The default batch (16 a rank), unlike the acceptance runs' 4: the attention's key bias has no gradient but rounding
# (softmax ignores a shift of every score), which Adam turns into steps of its own, so the weights of two runs that
# reduce in another order (1 rank against 2, compiled against eager) drift apart in that bias alone, the more the
# smaller the batch: 1.3e-5 at 8 and 4, past the checkpoint tests' 1e-5, where a real fault moves weights by 3e-4.
CURVE_OVERRIDES = (
    "model._target_=tests.models.checkpoint_probe.CheckpointProbeGPT",
    "+model.gathered_path=${paths.output_dir}/gathered_state.pt",
    "trainer.max_steps=30",
    "callbacks.model_checkpoint.every_n_train_steps=15",
    "callbacks.model_checkpoint.save_top_k=-1",
    "callbacks.model_checkpoint.monitor=null",
)


# The strategies whose 30-step curves the suite runs: each engine, with and without offload, and the checkpoint
# formats the other engines resume from (tests/checkpoints/test_cross_strategy_resume.py). The others' curves run in
# scripts/extended_checks.sh.
CURVES_IN_THE_SUITE = ["ddp", "fsdp", "deepspeed_stage_2", "deepspeed_stage_3", "deepspeed_stage_3_offload"]


def extended_run(config) -> bool:
    """Whether this run is the extended matrix's (`-m extended`), whose tests read every preset's curve."""
    return "extended" in (config.getoption("markexpr") or "")


@pytest.fixture(scope="session")
def curve_runs(tmp_path_factory, deepspeed_ops):
    """{strategy: StrategyCurve}, filled on demand so each strategy's 30-step run happens once per session."""
    from lightning_dist.reports.equivalence import run_strategy

    workdir = tmp_path_factory.mktemp("curves")
    runs = {}

    def get(name: str):
        if name not in runs:
            runs[name] = run_strategy(name, list(CURVE_OVERRIDES), workdir / name)
        return runs[name]

    return get


def documented_lines(readme: Path) -> list[tuple[str, str]]:
    """(command, its trailing comment) for every command in the shell code blocks of a README, as a user copies it:
    continuation lines joined, a leading `$ ` prompt dropped. Tests run these, not their own variants."""
    lines, in_block, pending = [], False, ""
    for line in readme.read_text().splitlines():
        if line.startswith("```"):
            in_block = line.strip() in ("```bash", "```sh", "```console")
            continue
        if not in_block or not (pending or line.strip()) or line.lstrip().startswith("#"):
            continue
        text = pending + line.strip().removeprefix("$ ")
        if text.endswith("\\"):
            pending = text[:-1].strip() + " "
            continue
        pending = ""
        command, _, comment = text.partition("  #")
        lines.append((command.strip(), comment.strip()))
    return lines


def documented_commands(readme: Path) -> list[str]:
    return [command for command, _ in documented_lines(readme)]


def documented(readme: Path, start: str) -> str:
    """The one command of `readme` that starts with `start`."""
    (command,) = [c for c in documented_commands(readme) if c.startswith(start)]
    return command


def run_documented(command: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    """A documented `python train.py ...`, `python -m ...` or `lightning-dist ...` command, run as typed from `cwd`
    (any directory: `train.py` is this repository's; `lightning-dist` this environment's)."""
    import shlex

    words = shlex.split(command)
    assert words[0] in ("python", "lightning-dist"), command
    if words[0] == "lightning-dist":
        words = ["python", "-m", "lightning_dist.commands", *words[1:]]  # the entry point's own function
    if words[1] == "train.py":
        words[1] = str(REPO / "train.py")
    return subprocess.run([sys.executable, *words[1:]], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=TRAIN_ENV)
