"""Offload preflight: NVMe directories and native ops, checked on the launching process with install hints."""

import os

import pytest

from lightning_dist.strategies.deepspeed.config.preflight import check_offload_ready, native_ops_needed, nvme_paths
from tests.conftest import needs_libaio


def nvme_config(path) -> dict:
    return {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(path)},
                                  "offload_param": {"device": "nvme", "nvme_path": str(path)}}}


def test_nvme_config_needs_cpu_adam_and_async_io():
    assert native_ops_needed(nvme_config("/x")) == ["CPUAdamBuilder", "AsyncIOBuilder"]
    assert native_ops_needed({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}) == ["CPUAdamBuilder"]
    assert native_ops_needed({"zero_optimization": {"stage": 3}}) == []
    assert list(nvme_paths(nvme_config("/x"))) == ["zero_optimization.offload_optimizer.nvme_path", "zero_optimization.offload_param.nvme_path"]


@needs_libaio
def test_a_writable_directory_with_libaio_installed_passes(tmp_path, deepspeed_ops):
    check_offload_ready(nvme_config(tmp_path))  # loads cpu_adam and async_io (built once per machine, then cached)
    assert list(tmp_path.iterdir()) == []  # the write test leaves nothing behind


def test_missing_directory_is_named(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="^offload cannot start: ") as raised:
        check_offload_ready(nvme_config(missing))
    assert f"zero_optimization.offload_param.nvme_path={missing}: no such directory" in str(raised.value)
    assert f"zero_optimization.offload_optimizer.nvme_path={missing}: no such directory" in str(raised.value)


def test_unwritable_directory_is_named(tmp_path):
    # Root writes through permission bits; /proc refuses new files to everyone.
    directory = "/proc" if os.geteuid() == 0 else tmp_path
    if directory == tmp_path:
        tmp_path.chmod(0o555)
    with pytest.raises(ValueError, match=f"nvme_path={directory}: not writable"):
        check_offload_ready(nvme_config(directory))


class _Buildable:
    NAME = "async_io"
    loaded = False

    def is_compatible(self, verbose=False):
        return True

    def load(self, verbose=False):
        _Buildable.loaded = True


def test_a_directory_to_fix_is_named_before_minutes_of_building(tmp_path, monkeypatch):
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(get_accelerator(), "create_op_builder", lambda name: _Buildable())
    with pytest.raises(ValueError, match="nvme_path=.*: no such directory"):
        check_offload_ready(nvme_config(tmp_path / "nope"))
    assert not _Buildable.loaded
    check_offload_ready(nvme_config(tmp_path))
    assert _Buildable.loaded  # with the directory right, the ops are built (and loaded) before launch


class _NoLibaio:
    NAME = "async_io"

    def is_compatible(self, verbose=False):
        return False


def test_missing_libaio_stops_the_run_before_cpu_adam_is_built(tmp_path, monkeypatch):
    """On a fresh machine CPU Adam's first build takes minutes: a run that cannot start for want of libaio's headers
    says so before it, not after (the H200 of 2026-12-04 built it first)."""
    from deepspeed.accelerator import get_accelerator

    _Buildable.loaded = False
    builders = {"AsyncIOBuilder": _NoLibaio(), "CPUAdamBuilder": _Buildable()}
    monkeypatch.setattr(get_accelerator(), "create_op_builder", builders.__getitem__)
    with pytest.raises(ValueError) as raised:
        check_offload_ready(nvme_config(tmp_path))
    assert str(raised.value) == (
        "offload cannot start: DeepSpeed's async_io op cannot be built here: install libaio's headers (apt-get install"
        " libaio-dev on Debian/Ubuntu, yum install libaio-devel on RHEL); `ds_report` then shows async_io [OKAY]")
    assert not _Buildable.loaded
