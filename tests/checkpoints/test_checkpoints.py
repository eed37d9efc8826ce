"""Checkpoints of every strategy consolidate into one plain file; wrong paths give errors that say what to pass."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from lightning_dist.checkpoints import CheckpointError, checkpoint_format, consolidate_checkpoint, load_consolidated
from lightning_dist.checkpoints.consolidate import main as consolidate_main
from tests import warm_python
from tests.conftest import CURVES_IN_THE_SUITE, REPO, STRATEGY_NAMES, extended_run, in_the_suite, run_train


@pytest.fixture(scope="session")
def plain_loads(curve_runs, tmp_path_factory, request) -> tuple[Path, dict[str, str]]:
    """Every preset's last checkpoint consolidated, then all of them loaded by one plain process: a fresh
    interpreter, which has not imported DeepSpeed (the warm one the suite forks has). The folder of consolidated
    files, and what the process said of each (name -> "OK" or the assertion that failed). Made once: pytest may
    order this module's tests around others of its worker, which would make a module fixture twice."""
    folder, files = tmp_path_factory.mktemp("consolidated"), []
    names = STRATEGY_NAMES if extended_run(request.config) else CURVES_IN_THE_SUITE
    for name in names:
        run = curve_runs(name)
        assert run.returncode == 0
        plain = consolidate_checkpoint(run.run_dir / "checkpoints" / "last.ckpt", folder / f"{name}.ckpt")
        files += [str(plain), str(run.run_dir / "gathered_state.pt")]
    process = subprocess.run([warm_python.REAL_PYTHON, "-m", "tests.checkpoints_plain_load", *files], cwd=REPO,
                             capture_output=True, text=True, timeout=600)
    said = dict(line.split(": ", 1) for line in process.stdout.splitlines() if ": " in line)
    assert len(said) == len(names), process.stdout + process.stderr[-3000:]
    return folder, {Path(path).stem: outcome for path, outcome in said.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", in_the_suite(STRATEGY_NAMES, CURVES_IN_THE_SUITE))
def test_consolidated_checkpoint_loads_strictly_in_a_plain_process(name, curve_runs, plain_loads):
    folder, said = plain_loads
    plain = folder / f"{name}.ckpt"
    assert checkpoint_format(plain) == "file"
    assert torch.load(plain, map_location="cpu", weights_only=True)["global_step"] == 30
    assert said[name] == "OK"
    run = curve_runs(name)
    # The one call for a module from the checkpoint as saved, a directory or a file: the trained weights.
    import lightning_dist
    from tests.models.checkpoint_probe import CheckpointProbeGPT

    module = lightning_dist.load_from_checkpoint(CheckpointProbeGPT, run.run_dir / "checkpoints" / "last.ckpt",
                                                 map_location="cpu")
    gathered = torch.load(run.run_dir / "gathered_state.pt", map_location="cpu")
    assert module.state_dict().keys() == gathered.keys()
    for key, tensor in gathered.items():
        assert torch.equal(module.state_dict()[key], tensor), key


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match=rf"^ckpt_path: no checkpoint at {tmp_path}/nope \(expected a \.ckpt file"):
        checkpoint_format(tmp_path / "nope")


def test_file_inside_a_deepspeed_directory_names_the_directory(tmp_path):
    directory = tmp_path / "last.ckpt"
    (directory / "checkpoint").mkdir(parents=True)
    (directory / "latest").write_text("checkpoint")
    shard = directory / "checkpoint" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    shard.write_bytes(b"")
    with pytest.raises(CheckpointError) as error:
        checkpoint_format(shard)
    assert str(error.value) == (
        f"ckpt_path: {shard} is one file inside the DeepSpeed checkpoint directory {directory}; pass the directory"
    )
    assert checkpoint_format(directory) == "deepspeed"


def test_directory_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="is a directory but not a checkpoint: expected a DeepSpeed checkpoint"):
        checkpoint_format(tmp_path)


def test_consolidation_never_overwrites(tmp_path, capsys):
    source, output = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    torch.save({"state_dict": {}}, source)
    output.write_text("precious")
    assert consolidate_main([str(source), str(output)]) == 2
    assert output.read_text() == "precious"
    assert capsys.readouterr().err.startswith(f"error: output: {output} exists;")


def test_consolidation_that_memory_cannot_hold_is_refused_up_front(tmp_path, capsys, monkeypatch):
    from lightning_dist.checkpoints import consolidate

    source, output = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1000)}}, source)
    monkeypatch.setattr(consolidate, "_available_memory", lambda: 1000)
    assert consolidate_main([str(source), str(output)]) == 2
    needed = consolidate.memory_needed(source)
    assert needed == 2 * source.stat().st_size
    assert capsys.readouterr().err.startswith(
        f"error: checkpoint: consolidating {source} needs about {needed / 1e9:.1f} GB of memory and 0.0 GB is available;")
    assert not output.exists()


def step_15(curve) -> str:
    return str(curve.run_dir / "checkpoints" / "step000015.ckpt")


@pytest.mark.slow
@pytest.mark.parametrize("target", in_the_suite(["fsdp", "ddp"], ["fsdp"]))
def test_zero3_checkpoint_from_two_ranks_resumes_on_one_rank_under(target, curve_runs, tmp_path):
    from lightning_dist.reports.equivalence import run_strategy
    from tests.conftest import CURVE_OVERRIDES

    source = curve_runs("deepspeed_stage_3")
    # One rank with twice the batch: the same global batch, and (the data position being in samples) the same
    # samples in every step as the 2-rank run.
    resumed = run_strategy(
        target, [*CURVE_OVERRIDES, "trainer.devices=1", "data.batch_size=32", f"ckpt_path={step_15(source)}"],
        tmp_path / target,
    )
    assert resumed.returncode == 0
    assert json.loads((resumed.run_dir / "metrics.json").read_text())["world_size"] == 1
    saved = load_consolidated(step_15(source))
    restored_weights = torch.load(resumed.run_dir / "initial_state.pt")
    for name, tensor in saved["state_dict"].items():
        torch.testing.assert_close(restored_weights[name], tensor, rtol=0, atol=0, msg=name)
    # Adam's moments came along from ZeRO-3's partitions, parameter by parameter.
    restored_moments = torch.load(resumed.run_dir / "initial_optimizer_state.pt")
    assert set(restored_moments) == set(saved["optimizer_state_by_name"])
    for name, state in saved["optimizer_state_by_name"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(restored_moments[name][key], state[key], rtol=0, atol=0, msg=f"{name} {key}")
    # So training goes on as the 2-rank run's did: the same samples in every step (the data position is in
    # samples), and after 15 more steps the same weights. The logged loss there is the mean of its two ranks' halves
    # of the batch (models/gpt.py), which is this rank's loss of the whole batch.
    assert sorted(resumed.losses) == list(range(15, 30))
    for step in (15, 16, 17):
        assert resumed.losses[step] == pytest.approx(source.losses[step], rel=1e-4), step
    final, uninterrupted = (torch.load(run.run_dir / "gathered_state.pt") for run in (resumed, source))
    del final["bytes_seen"], uninterrupted["bytes_seen"]  # each rank's own count: rank 0's half in the 2-rank run
    for name, tensor in uninterrupted.items():
        torch.testing.assert_close(final[name], tensor, rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_checkpoint_of_another_model_is_refused_before_spawning(curve_runs, tmp_path):
    source = curve_runs("fsdp")
    run = run_train(tmp_path, "strategy=fsdp", "model.n_layer=2", f"ckpt_path={step_15(source)}")
    assert run.process.returncode == 2
    assert (f"error: ckpt_path: {step_15(source)} holds another model's weights: 0 of this model's keys are missing"
            " (e.g. -) and 33 are not in this model (e.g. bytes_seen, model.blocks.2.attn.k.bias,"
            " model.blocks.2.attn.k.weight)") in run.process.stderr
    assert "Initializing distributed" not in run.output


@pytest.mark.slow
@pytest.mark.parametrize("name", in_the_suite(["fsdp", "deepspeed_stage_3"], ["fsdp"]))
def test_checkpoint_with_the_same_names_but_other_shapes_is_refused_before_spawning(name, curve_runs, tmp_path):
    # Shapes read from metadata: DCP's, and ZeRO-3's recorded shapes beside its empty placeholders (ZeRO-1/2 keep
    # whole tensors in their module states, read like a .ckpt file's, which tests/test_config_errors.py covers).
    from tests.conftest import CURVE_OVERRIDES

    run = run_train(tmp_path, f"strategy={name}", *CURVE_OVERRIDES, "model.d_model=256", f"ckpt_path={step_15(curve_runs(name))}")
    assert run.process.returncode == 2
    assert (f"error: ckpt_path: {step_15(curve_runs(name))} holds another model's weights: 69 have other shapes (e.g."
            " model.token_embedding.weight is [256, 128] there and [256, 256] in this model)") in run.process.stderr
    assert "Initializing distributed" not in run.output


def test_only_deepspeed_directories_convert_to_universal(tmp_path, capsys):
    from lightning_dist.strategies.deepspeed.universal import main as universal_main

    plain = tmp_path / "model.ckpt"
    torch.save({"state_dict": {}}, plain)
    assert universal_main([str(plain)]) == 2
    assert capsys.readouterr().err == (
        f"error: ckpt_path: {plain} is not a DeepSpeed checkpoint directory; only those convert to universal\n"
    )
