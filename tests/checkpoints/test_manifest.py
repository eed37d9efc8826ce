"""A checkpoint proves it is whole: a directory by its manifest (sizes, CRC-32), a .ckpt file by its zip CRCs, a
directory saved without a manifest by the files its format names."""

from __future__ import annotations

import pytest
import torch

from lightning_dist.checkpoints import CheckpointError
from lightning_dist.checkpoints.manifest import write_manifest
from lightning_dist.checkpoints.whole import check_whole, first_problem, is_whole


def flip_a_byte(path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def shards(tmp_path):
    """A DCP-like directory: two shards, the metadata and Lightning's meta.pt, with its manifest."""
    directory = tmp_path / "last.ckpt"
    directory.mkdir()
    for rank in (0, 1):
        torch.save({"w": torch.arange(1000.0) + rank}, directory / f"__{rank}_0.distcp")
    (directory / ".metadata").write_bytes(b"metadata")
    torch.save({"global_step": 5}, directory / "meta.pt")
    write_manifest(directory)
    return directory


def test_a_whole_directory_passes(shards):
    assert first_problem(shards) is None and is_whole(shards)
    assert not list(shards.glob(".*.partial"))  # the manifest was renamed into place


def test_a_flipped_byte_in_a_shard_is_named(shards):
    flip_a_byte(shards / "__1_0.distcp")
    assert first_problem(shards) == f"{shards / '__1_0.distcp'} does not match its checksum: its contents changed after the save"
    assert not is_whole(shards)
    with pytest.raises(CheckpointError) as error:
        check_whole(shards)
    assert str(error.value) == (f"ckpt_path: {shards} is damaged: {shards / '__1_0.distcp'} does not match its checksum:"
                                " its contents changed after the save; pass another checkpoint, or resume=true to"
                                " continue from the newest whole one")


def test_a_deleted_or_truncated_shard_is_named(shards):
    (shards / "__0_0.distcp").unlink()
    assert first_problem(shards) == f"{shards / '__0_0.distcp'} is missing"
    shard = shards / "__1_0.distcp"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:100])
    (shards / "__0_0.distcp").write_bytes(b"")  # back, but empty
    assert first_problem(shards).startswith(f"{shards / '__0_0.distcp'} has 0 bytes, ")
    assert size > 100


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process, on purpose
def test_a_dcp_directory_without_a_manifest_needs_every_file_its_metadata_names(tmp_path):
    import torch.distributed.checkpoint as dcp

    directory = tmp_path / "saved_by_lightning"
    dcp.save({"w": torch.arange(1000.0), "b": torch.ones(10)}, checkpoint_id=str(directory), no_dist=True)
    torch.save({"global_step": 5}, directory / "meta.pt")
    (shard,) = directory.glob("*.distcp")
    assert first_problem(directory) is None and is_whole(directory)
    shard.write_bytes(shard.read_bytes()[:100])
    assert first_problem(directory).startswith(f"{shard} has 100 bytes, its .metadata points at byte ")
    shard.unlink()
    assert first_problem(directory) == f"{shard} is missing (its .metadata names it)"
    assert not is_whole(directory)


def test_a_deepspeed_directory_without_a_manifest_needs_a_shard_per_saved_rank(tmp_path):
    directory, tag = tmp_path / "saved_by_deepspeed", tmp_path / "saved_by_deepspeed" / "global_step4"
    tag.mkdir(parents=True)
    (directory / "latest").write_text("global_step4")
    for rank in (0, 1):
        torch.save({"dp_world_size": 2, "module": None}, tag / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        torch.save({"state": torch.ones(3)}, tag / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    assert first_problem(directory) is None and is_whole(directory)
    (tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    assert first_problem(directory) == f"{tag / 'bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt'} is missing (the save had 2 ranks)"
    assert not is_whole(directory)


def test_a_ckpt_file_is_checked_against_its_zip_crcs(tmp_path):
    path = tmp_path / "step000010.ckpt"
    torch.save({"state_dict": {"w": torch.arange(100_000.0)}}, path)
    assert first_problem(path) is None and is_whole(path)
    flip_a_byte(path, at=0.5)  # inside the tensor's record
    assert first_problem(path) == "its record step000010/data/0 does not match its checksum: its contents changed after the save"
    assert not is_whole(path)
