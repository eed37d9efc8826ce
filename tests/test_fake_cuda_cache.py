"""The device shim's cache (~/.cache/lightning_dist/fake_cuda) outlives venvs. A library built against a venv's torch
finds libc10 by that venv's path: when the venv is made again elsewhere with the same torch release (CI makes the
tier's venvs afresh each run), the cached library must not be reused, or every dry run on fake CUDA ends with
"libc10.so: cannot open shared object file"."""

from __future__ import annotations

import importlib.util

from lightning_dist._compat import fake_cuda


def device_count_seen() -> int:
    import torch

    return torch.cuda.device_count()


# Not in the compatibility tier: which library a venv takes is this module's choice, the same on every torch, and
# the tier's own dry runs on fake CUDA build the shim against its torch in its fresh venvs (about 70 s of CI).
def test_a_venv_made_again_elsewhere_builds_its_own_shim(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    real_torch = importlib.util.find_spec("torch").submodule_search_locations[0]

    def torch_installed_at(venv: str) -> None:
        site = tmp_path / venv / "site-packages"
        site.mkdir(parents=True)
        (site / "torch").symlink_to(real_torch)
        spec = importlib.util.spec_from_file_location("torch", site / "torch" / "__init__.py",
                                                      submodule_search_locations=[str(site / "torch")])
        monkeypatch.setattr(fake_cuda.importlib.util, "find_spec", lambda name: spec)

    torch_installed_at("first_venv")
    first = fake_cuda.shim_library(2)
    (tmp_path / "first_venv" / "site-packages" / "torch").unlink()  # the venv removed

    torch_installed_at("second_venv")
    second = fake_cuda.shim_library(2)
    assert second != first
    # The dry run's own path, in the second venv: the library it takes loads, and torch sees the faked devices.
    assert fake_cuda.run_with_fake_cuda(device_count_seen, devices=2) == 2
