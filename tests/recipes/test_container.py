"""recipes/container/Dockerfile, read as the build would run it: its torch is in pyproject.toml's range and built for
the image's CUDA, it installs this package with extras that exist, compiles the ops of a preset that exists for
CUDA into the venv, and starts the training command. (No container runtime here: the image itself is built on a
GPU node.)"""

from __future__ import annotations

import re

import tomllib
from packaging.specifiers import SpecifierSet

from lightning_dist.strategies.presets import PRESETS
from tests.conftest import REPO

DOCKERFILE = (REPO / "recipes" / "container" / "Dockerfile").read_text()
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def argument(name: str) -> str:
    (value,) = re.findall(rf"^ARG {name}=(\S+)$", DOCKERFILE, flags=re.M)
    return value.strip('"')


def test_its_torch_is_one_we_support_built_for_the_images_cuda():
    torch_range = next(SpecifierSet(d.removeprefix("torch")) for d in PROJECT["dependencies"] if d.startswith("torch>"))
    assert argument("TORCH") in torch_range
    cuda = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-cudnn-devel-ubuntu\d+\.\d+", argument("CUDA_IMAGE"))
    assert cuda is not None  # devel: nvcc, which DeepSpeed's ops compile with
    assert argument("TORCH_INDEX") == f"https://download.pytorch.org/whl/cu{cuda[1]}{cuda[2]}"
    assert 'RUN pip install "torch==${TORCH}" --index-url "${TORCH_INDEX}"' in DOCKERFILE


def test_it_installs_the_package_compiles_a_presets_ops_for_cuda_and_starts_training():
    (extras,) = re.findall(r'RUN pip install "/opt/lightning-dist\[([\w,]+)\]"', DOCKERFILE)
    assert set(extras.split(",")) <= set(PROJECT["optional-dependencies"])
    (preset,) = re.findall(r"RUN DS_ACCELERATOR=cuda lightning-dist prepare (\w+)$", DOCKERFILE, flags=re.M)
    assert preset in PRESETS and "libaio-dev" in DOCKERFILE  # the NVMe preset's async_io needs libaio's headers
    (entrypoint,) = re.findall(r'^ENTRYPOINT \["([\w-]+)"\]$', DOCKERFILE, flags=re.M)
    assert entrypoint in PROJECT["scripts"] and "lightning-dist" in PROJECT["scripts"]
