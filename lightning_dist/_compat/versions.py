"""The library versions the fence was checked on, read from our own package's requirements (pyproject.toml is
the one place they are written), and a one-line notice at import when an installed one is outside them."""

from __future__ import annotations

import importlib.metadata as metadata
import sys

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

PACKAGE = "lightning-dist"
FENCED_LIBRARIES = ("torch", "lightning", "deepspeed", "hydra-core")


def requirements() -> dict[str, str]:
    """{library: version specifier} for each fenced library, as this package requires it; empty when the package
    runs from a source tree that was never installed (no metadata to read)."""
    try:
        declared = metadata.requires(PACKAGE) or []
    except metadata.PackageNotFoundError:
        return {}
    found = {}
    for line in declared:
        requirement = Requirement(line)
        if requirement.name in FENCED_LIBRARIES and requirement.marker is None:
            # The range as it reads: its lower bound first (">=2.11,<2.16"), where packaging sorts as text.
            found[requirement.name] = ",".join(sorted(map(str, requirement.specifier), key=lambda s: (s[0] != ">", s)))
    return found


def unsupported() -> list[tuple[str, str, str]]:
    """(library, installed version, supported versions) for each installed library outside its range."""
    outside = []
    for name, specifier in requirements().items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # pip reports a missing requirement itself
        try:
            supported = Requirement(f"{name}{specifier}").specifier.contains(Version(installed), prereleases=True)
        except InvalidVersion:
            supported = False
        if not supported:
            outside.append((name, installed, specifier))
    return outside


def warn_if_unsupported() -> None:
    for name, installed, specifier in unsupported():
        print(f"{PACKAGE}: {name} {installed} is installed; the supported versions are {specifier}"
              " (what its internals were checked on, lightning_dist/_compat)", file=sys.stderr)
