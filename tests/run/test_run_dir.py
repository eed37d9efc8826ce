"""A run directory belongs to one run (lightning_dist/run/run_dir.py): a second run into a fixed hydra.run.dir
is refused in one line before anything is written, whether the first has finished or is still going."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_dist.run import run_dir
from lightning_dist.run.config_check import ConfigError
from lightning_dist.run.run_dir import CLAIM_ENV, CLAIM_FILE, claim_run_dir, discard_refused_run
from tests.conftest import REPO, TRAIN_ENV, run_train, train_command


@pytest.fixture
def unclaimed(monkeypatch):
    """This process as a fresh launching process: no claim of its own, none inherited, rank 0."""
    monkeypatch.setattr(run_dir, "_claim", None)
    for name in (CLAIM_ENV, *run_dir.RANK_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    yield
    if run_dir.current_claim() is not None:
        run_dir.current_claim().lock.close()


def files_of(directory: Path) -> dict[str, bytes]:
    return {str(path.relative_to(directory)): path.read_bytes() for path in sorted(directory.rglob("*")) if path.is_file()}


@pytest.mark.parametrize("left", ["metrics.json", "checkpoints/last.ckpt", CLAIM_FILE])
def test_a_directory_another_run_used_is_refused_unless_continued_on_purpose(tmp_path, unclaimed, left):
    (tmp_path / left).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / left).write_text("the earlier run's")
    with pytest.raises(ConfigError) as error:
        claim_run_dir(tmp_path, continuing=False)
    assert str(error.value) == (
        f"hydra.run.dir: {tmp_path} holds another run ({Path(left).parts[0]}); choose another directory, or continue "
        "that run on purpose with resume=true or ckpt_path=<its checkpoint>"
    )
    assert (tmp_path / left).read_text() == "the earlier run's"
    claim = claim_run_dir(tmp_path, continuing=True)
    assert claim is not None and not claim.created and claim.directory == tmp_path


def test_a_new_directory_is_created_claimed_and_handed_to_the_ranks(tmp_path, unclaimed, monkeypatch):
    directory = tmp_path / "runs" / "new"
    claim = claim_run_dir(directory, continuing=False)
    assert claim.created and (directory / CLAIM_FILE).is_file()
    # The ranks this process starts inherit the claim; a rank a cluster started leaves it to rank 0.
    assert claim_run_dir(directory, continuing=False) is claim
    monkeypatch.setattr(run_dir, "_claim", None)
    assert claim_run_dir(directory, continuing=False) is None
    monkeypatch.delenv(CLAIM_ENV)
    monkeypatch.setenv("SLURM_PROCID", "1")
    assert claim_run_dir(tmp_path / "elsewhere", continuing=False) is None
    assert not (tmp_path / "elsewhere").exists()


def test_a_directory_in_use_is_refused_even_when_continuing(tmp_path, unclaimed):
    holder = subprocess.Popen(  # claims the directory, and holds it until told to exit
        [sys.executable, "-c", "import sys; from pathlib import Path\n"
         "from lightning_dist.run.run_dir import claim_run_dir\n"
         f"claim_run_dir(Path({str(tmp_path)!r}), continuing=False); print('claimed', flush=True); sys.stdin.readline()"],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "claimed"
        with pytest.raises(ConfigError, match=rf"^hydra.run.dir: {tmp_path} is in use by a run still going \(pid \d+ on "
                                               r".+, started .+\); choose another directory$"):
            claim_run_dir(tmp_path, continuing=True)
    finally:
        holder.communicate("\n", timeout=60)
    assert claim_run_dir(tmp_path, continuing=True) is not None  # the lock went with its process


def write_what_hydra_writes(directory: Path) -> None:
    (directory / ".hydra").mkdir()
    (directory / ".hydra" / "config.yaml").write_text("seed: 2\n")
    (directory / "train.log").write_text("refused\n")


@pytest.mark.parametrize("existed", [True, False], ids=["an empty directory", "a new one"])
def test_a_refused_run_leaves_nothing_and_its_directory_can_be_used_again(tmp_path, unclaimed, monkeypatch, existed):
    directory = tmp_path if existed else tmp_path / "new"
    claim_run_dir(directory, continuing=False)
    write_what_hydra_writes(directory)
    discard_refused_run(directory, "train")
    assert (list(directory.iterdir()) == []) if existed else not directory.exists()
    monkeypatch.setattr(run_dir, "_claim", None)
    monkeypatch.delenv(CLAIM_ENV)
    assert claim_run_dir(directory, continuing=False) is not None


def an_earlier_attempt(directory: Path, seed: int) -> dict[str, bytes]:
    (directory / ".hydra").mkdir()
    (directory / ".hydra" / "config.yaml").write_text(f"seed: {seed}\n")
    (directory / "metrics.json").write_text(f'{{"seed": {seed}}}')
    (directory / "train.log").write_text(f"attempt with seed {seed}\n")
    return files_of(directory)


def test_a_continued_run_sets_the_earlier_attempts_config_and_summary_aside_under_one_number(tmp_path, unclaimed, monkeypatch):
    first = an_earlier_attempt(tmp_path, 1)
    claim_run_dir(tmp_path, continuing=True)
    assert files_of(tmp_path) == {".hydra.1/config.yaml": first[".hydra/config.yaml"],
                                  "metrics.1.json": first["metrics.json"], "train.log": first["train.log"],
                                  CLAIM_FILE: (tmp_path / CLAIM_FILE).read_bytes()}
    # A third attempt: the second's files take the next number, whatever Hydra's config directory is called.
    run_dir.current_claim().lock.close()
    monkeypatch.setattr(run_dir, "_claim", None)
    monkeypatch.delenv(CLAIM_ENV)
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text("seed: 2\n")
    (tmp_path / "metrics.json").write_text('{"seed": 2}')
    claim_run_dir(tmp_path, continuing=True, config_dir="config")
    assert (tmp_path / "config.2" / "config.yaml").read_text() == "seed: 2\n"
    assert (tmp_path / "metrics.2.json").read_text() == '{"seed": 2}'
    assert not (tmp_path / "config").exists() and not (tmp_path / "metrics.json").exists()


def test_a_refused_continuation_leaves_the_earlier_run_as_it_was(tmp_path, unclaimed):
    before = an_earlier_attempt(tmp_path, 1)
    claim_run_dir(tmp_path, continuing=True)
    write_what_hydra_writes(tmp_path)  # the refused attempt's config
    discard_refused_run(tmp_path, "train")
    after = files_of(tmp_path)
    assert after == {**before, "train.log": b"refused\n"}  # the claim file too is gone: the earlier run had none


# --------------------------------------------------------------------------- as typed: python train.py hydra.run.dir=X


def assert_refused_in_one_line(process: subprocess.CompletedProcess, reason: str) -> None:
    assert process.returncode == 2, process.stderr[-2000:]
    assert process.stderr.startswith("error: hydra.run.dir: ") and reason in process.stderr
    assert process.stderr.count("\n") == 1 and "Traceback" not in process.stdout + process.stderr


@pytest.mark.slow
def test_a_second_run_into_a_finished_runs_directory_leaves_every_file_as_it_was(trained_runs):
    first = trained_runs("ddp")
    before = files_of(first.run_dir)
    assert {"metrics.json", ".hydra/config.yaml", "csv/metrics.csv", "checkpoints/last.ckpt"} <= set(before)
    second = run_train(first.run_dir, "seed=2", "trainer.max_steps=3")
    assert_refused_in_one_line(second.process, "holds another run (metrics.json, checkpoints)")
    assert files_of(first.run_dir) == before


@pytest.mark.slow
def test_resume_into_a_finished_runs_own_directory_trains_nothing_and_leaves_its_files(tmp_path):
    """As a SLURM script resubmits a job that had finished: the continuation sets the run's metrics.json aside as it
    claims the directory, and the finished-run check used to read the moved file as missing, resume from the last
    save, train nothing, exit 0 with an empty `Final metrics:` line and leave metrics.1.json behind."""
    first = run_train(tmp_path, "trainer.max_steps=2", "test=false")
    assert first.process.returncode == 0, first.output[-2000:]
    before = files_of(tmp_path)
    again = run_train(tmp_path, "trainer.max_steps=2", "test=false", "resume=true")
    assert again.process.returncode == 0, again.output[-2000:]
    said = again.output.split(" - ", 1)[-1]  # the path as the run spelled it (pytest's tmp_path has a link to it)
    assert said.startswith("resume=true: nothing left to train: the newest whole checkpoint of this command, "), said
    assert "/checkpoints/last.ckpt, is the last save of a run that trained to its end (" in said
    assert "Final metrics" not in again.output and "Training " not in again.output
    after = files_of(tmp_path)
    assert after.pop("train.log").startswith(before.pop("train.log"))  # the job's log says what this attempt did
    assert after == before


@pytest.mark.slow
def test_a_second_run_while_the_first_is_going_is_refused_and_the_first_finishes(tmp_path):
    first = subprocess.Popen(train_command(tmp_path, "trainer.max_steps=2", "test=false"), cwd=REPO, env=TRAIN_ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    claim, deadline = tmp_path / CLAIM_FILE, time.monotonic() + 60
    while not (claim.exists() and claim.stat().st_size):  # written once the first run holds the lock
        assert time.monotonic() < deadline and first.poll() is None
        time.sleep(0.1)
    second = run_train(tmp_path, "trainer.max_steps=2", "test=false", "resume=true")
    assert_refused_in_one_line(second.process, "is in use by a run still going")
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-2000:]
    assert "Final metrics: " in out
