"""A checkpoint is read as data: one that names code to run is refused, in every format, unless the user opts in."""

from __future__ import annotations

import ast
import io
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from lightning_dist.checkpoints.consolidate import main as consolidate_main
from lightning_dist.checkpoints.formats import deepspeed_tag_dir
from lightning_dist.checkpoints.safe_load import UnsafeCheckpointError, vet_checkpoint
from tests.conftest import CURVE_OVERRIDES, REPO, run_train


class Payload:
    """Unpickling this creates `marker`: the stand-in for an attacker's code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_the_package_loads_pickles_only_through_safe_load():
    """Every torch.load/pickle.load call in the package is in safe_load.py, and weights_only=False is passed only
    where the caller said the checkpoint is trusted."""
    calls = []
    for source in sorted((REPO / "lightning_dist").rglob("*.py")):
        tree = ast.parse(source.read_text())
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load":
                    if isinstance(node.func.value, ast.Name) and node.func.value.id in ("torch", "pickle"):
                        unsafe = any(k.arg == "weights_only" and getattr(k.value, "value", None) is False for k in node.keywords)
                        calls.append((source.name, function.name, unsafe))
    assert sorted(calls) == [("safe_load.py", "_vet_distributed", False), ("safe_load.py", "load_file", False),
                             ("safe_load.py", "load_file", True)]
    load_file = (REPO / "lightning_dist" / "checkpoints" / "safe_load.py").read_text().split("def load_file")[1]
    assert "    if trusted:\n        return torch.load(path, weights_only=False, **kwargs)" in load_file


def _inject(file: Path, marker: Path) -> None:
    """Add a payload to the dict a torch.save'd file holds, keeping everything else."""
    checkpoint = torch.load(file, map_location="cpu", weights_only=False)
    checkpoint["extra"] = Payload(marker)
    torch.save(checkpoint, file)


def _inject_into_dcp_metadata(directory: Path, marker: Path) -> None:
    metadata = pickle.loads((directory / ".metadata").read_bytes())
    metadata.storage_meta.modules = [Payload(marker)]
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.slow
@pytest.mark.parametrize("name, target", [
    ("ddp", "last.ckpt"),
    ("fsdp", "meta.pt"),
    ("fsdp", ".metadata"),
    ("deepspeed_stage_2", "optim_states.pt"),
    ("deepspeed_stage_3", "model_states.pt"),
])
def test_a_payload_anywhere_in_a_checkpoint_is_refused(name, target, curve_runs, tmp_path, capsys):
    checkpoint = tmp_path / "last.ckpt"
    source = curve_runs(name).run_dir / "checkpoints" / "last.ckpt"
    (shutil.copytree if source.is_dir() else shutil.copy)(source, checkpoint)
    vet_checkpoint(checkpoint)  # as saved: data only
    marker = tmp_path / "payload_ran"
    if target == ".metadata":
        _inject_into_dcp_metadata(checkpoint, marker)
    elif checkpoint.is_dir():
        shards = [checkpoint / target] if name == "fsdp" else sorted(deepspeed_tag_dir(checkpoint).glob(f"*{target}"))
        _inject(shards[-1], marker)  # the last rank's shard: not only the first file is read
    else:
        _inject(checkpoint, marker)
    with pytest.raises(UnsafeCheckpointError) as error:
        vet_checkpoint(checkpoint)
    assert str(error.value).startswith(f"ckpt_path: {checkpoint}")
    assert "holds a reference to io.open, code that loading it would run: refused; if you trust" in str(error.value)
    assert consolidate_main([str(checkpoint), str(tmp_path / "plain.ckpt")]) == 2
    assert "io.open" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "plain.ckpt").exists()


@pytest.mark.slow
def test_train_refuses_a_payload_and_loads_it_only_when_trusted(curve_runs, tmp_path):
    checkpoint, marker = tmp_path / "step15.ckpt", tmp_path / "payload_ran"
    shutil.copy(curve_runs("ddp").run_dir / "checkpoints" / "step000015.ckpt", checkpoint)
    _inject(checkpoint, marker)
    overrides = (*CURVE_OVERRIDES[:2], "trainer.max_steps=17", "test=false", f"ckpt_path={checkpoint}")

    refused = run_train(tmp_path / "refused", *overrides)
    assert refused.process.returncode == 2
    assert (f"error: ckpt_path: {checkpoint} holds a reference to io.open, code that loading it would run:"
            " refused; if you trust where it came from, opt in with trust_checkpoint=true") in refused.process.stderr
    assert "Initializing distributed" not in refused.output and not marker.exists()

    trusted = run_train(tmp_path / "trusted", *overrides, "trust_checkpoint=true")
    assert trusted.process.returncode == 0, trusted.output[-3000:]
    assert marker.exists()  # the opt-in really loads the pickle as it is
    assert trusted.summary["global_step"] == 17  # and resumed from its step 15


@pytest.mark.slow
def test_consolidated_files_load_with_weights_only(curve_runs, tmp_path):
    for name in ("fsdp", "deepspeed_stage_3"):
        output = tmp_path / f"{name}.ckpt"
        assert consolidate_main([str(curve_runs(name).run_dir / "checkpoints" / "last.ckpt"), str(output)]) == 0
        checkpoint = torch.load(output, map_location="cpu", weights_only=True)
        assert checkpoint["global_step"] == 30 and checkpoint["optimizer_state_by_name"]


def test_distributed_metadata_unpickler_refuses_foreign_globals(tmp_path):
    from lightning_dist.checkpoints.safe_load import _MetadataUnpickler

    with pytest.raises(pickle.UnpicklingError, match="GLOBAL io.open"):
        _MetadataUnpickler(io.BytesIO(pickle.dumps(Payload(tmp_path / "x")))).load()
    assert not (tmp_path / "x").exists()


class _EnumsAsPython3112Pickles(pickle.Pickler):
    """Pickles an enum member as Python 3.11.0-3.11.4 do (Debian 12's 3.11.2, for one): getattr(its class, its
    name). Every FSDP checkpoint saved there has its tensors' memory format so in `.metadata`."""

    def reducer_override(self, obj):
        import enum

        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


class _GetattrPayload:
    """getattr of a class the unpickler allows, for an attribute that is no enum member: the first step of a chain
    that would reach any object."""

    def __reduce__(self):
        import collections

        return getattr, (collections.OrderedDict, "fromkeys")


def test_metadata_of_a_python_that_pickles_enums_by_getattr_is_data_and_getattr_stays_closed(tmp_path):
    """Refused as 'code that loading it would run' before: a user's own FSDP checkpoints, saved under Debian 12's
    Python, could not be resumed (scripts/fault_cases.py found it running as nobody with the system interpreter)."""
    from torch.distributed.checkpoint import save

    from lightning_dist.checkpoints.safe_load import _MetadataUnpickler

    save({"state_dict": {"weight": torch.zeros(4)}}, checkpoint_id=tmp_path / "ckpt")
    torch.save({"global_step": 1}, tmp_path / "ckpt" / "meta.pt")
    metadata = pickle.loads((tmp_path / "ckpt" / ".metadata").read_bytes())
    buffer = io.BytesIO()
    _EnumsAsPython3112Pickles(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(metadata)
    assert b"getattr" in buffer.getvalue()
    (tmp_path / "ckpt" / ".metadata").write_bytes(buffer.getvalue())
    vet_checkpoint(tmp_path / "ckpt")  # no UnsafeCheckpointError
    loaded = _MetadataUnpickler(io.BytesIO(buffer.getvalue())).load()
    assert loaded.state_dict_metadata.keys() == metadata.state_dict_metadata.keys()
    with pytest.raises(pickle.UnpicklingError, match="GLOBAL builtins.getattr"):
        _MetadataUnpickler(io.BytesIO(pickle.dumps(_GetattrPayload()))).load()


def test_a_load_works_out_the_format_and_vets_once(tmp_path, monkeypatch):
    """One CheckpointSource per load: however many steps read it, the format is found and the pickles vetted once."""
    from lightning_dist.checkpoints import formats, safe_load
    from lightning_dist.checkpoints import source as source_module
    from lightning_dist.checkpoints.source import CheckpointSource

    path = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}}, path)
    calls = {"format": 0, "vet": 0}
    real_format, real_vet = formats.checkpoint_format, safe_load.vet_checkpoint

    def counting_format(*args, **kwargs):
        calls["format"] += 1
        return real_format(*args, **kwargs)

    def counting_vet(*args, **kwargs):
        calls["vet"] += 1
        return real_vet(*args, **kwargs)

    monkeypatch.setattr(source_module, "checkpoint_format", counting_format)
    monkeypatch.setattr(source_module, "vet_checkpoint", counting_vet)
    source = CheckpointSource.of(path)
    assert (source.format, source.readable) == ("file", False)
    vetted = source.vet().vet()  # a second step asking again does not vet again
    assert vetted.readable and calls == {"format": 1, "vet": 1}
    assert CheckpointSource.of(vetted) is vetted
    assert CheckpointSource.of(path, trusted=True).vet().readable and calls["vet"] == 1  # trusted: never vetted


def test_the_edge_works_out_a_checkpoint_once_and_hands_the_strategy_that_source(tmp_path, monkeypatch):
    """`ckpt_path=` is classified and vetted once, before launch: every check (whole, this model's, the layout) and
    the strategy's load read the one CheckpointSource, which Lightning takes as the path it is."""
    import os
    import sys
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from lightning_dist.checkpoints import formats, safe_load
    from lightning_dist.run.compose import _checked_checkpoint

    path = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "global_step": 3}, path)
    calls = {"format": 0, "vet": 0}
    real_format, real_vet = formats.checkpoint_format, safe_load.vet_checkpoint

    def counting(name, real):
        def count(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return count

    for module in [m for n, m in sys.modules.items() if n.startswith("lightning_dist.")]:  # wherever it was imported
        for name, real in (("format", real_format), ("vet", real_vet)):
            attribute = {"format": "checkpoint_format", "vet": "vet_checkpoint"}[name]
            if getattr(module, attribute, None) is real:
                monkeypatch.setattr(module, attribute, counting(name, real))
    cfg = OmegaConf.create({"ckpt_path": str(path), "trust_checkpoint": False})
    source = _checked_checkpoint(cfg, {"w": (2,)}, SimpleNamespace(checkpoint_tensor_parallel=None))
    assert calls == {"format": 1, "vet": 1} and source.readable and os.fspath(source) == str(path)
    # The strategy's side (checkpoints/resume.py, strategies/deepspeed/load.py) takes it as it is.
    from lightning_dist.checkpoints.source import CheckpointSource

    assert CheckpointSource.of(source) is source and calls["format"] == 1
    assert torch.load(source, weights_only=True)["global_step"] == 3  # a path to torch, as to Lightning
