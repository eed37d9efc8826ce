"""Checkpoints that prove they are whole: what a save wrote, file by file, with sizes and checksums, checked before
a checkpoint is resumed from.

A marker file (DCP's `.metadata`, Lightning's `meta.pt`, DeepSpeed's `latest`) says only that the save got to its
end; it says nothing of a shard deleted, truncated or corrupted since, and `torch.load` never checks the CRC-32 that
a `.ckpt` (a zip archive) carries per record. So:

- a checkpoint directory gets `manifest.json` as the last file of its save, before it is swapped into place
  (swap.py): every file's size and CRC-32 (zlib's: 0.32 s per GiB on our 2-core machines,
  `python benchmarks/checksum_cost.py`);
- a `.ckpt` file is checked against its own zip CRCs;
- a directory without a manifest (saved by another tool) is checked against what its format names (whole.py).
"""

from __future__ import annotations

import json
import os
import zipfile
import zlib
from pathlib import Path

MANIFEST = "manifest.json"
_CHUNK = 1 << 20


def crc32_of(path: Path) -> int:
    crc = 0
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(directory: Path) -> Path:
    """Record every file under `directory` (size, CRC-32); written beside them, then renamed into place, so that
    a manifest that exists is whole."""
    files = {
        str(path.relative_to(directory)): {"size": path.stat().st_size, "crc32": crc32_of(path)}
        for path in sorted(directory.rglob("*")) if path.is_file() and path.name != MANIFEST
    }
    written = directory / f".{MANIFEST}.partial"
    written.write_text(json.dumps({"checksum": "crc32", "files": files}, indent=1))
    final = directory / MANIFEST
    os.replace(written, final)
    return final


def has_manifest(directory: Path) -> bool:
    return (directory / MANIFEST).is_file()


def manifest_problem(directory: Path) -> str | None:
    """What of a directory differs from its manifest (naming the file), or None: every file recorded is there, with
    its size and checksum."""
    manifest = directory / MANIFEST
    try:
        recorded = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"{manifest} cannot be read"
    for name, expected in recorded.items():
        file = directory / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != expected["size"]:
            return f"{file} has {file.stat().st_size} bytes, {expected['size']} were saved"
        if crc32_of(file) != expected["crc32"]:
            return f"{file} does not match its checksum: its contents changed after the save"
    return None


def zip_problem(path: Path) -> str | None:
    """What is wrong with a `.ckpt` file's zip records ("its ..."), or None: every record's CRC-32 matches."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()  # reads every record and checks its CRC-32
    except (zipfile.BadZipFile, OSError) as error:
        return f"it is not a whole zip archive ({error})"
    return None if bad is None else f"its record {bad} does not match its checksum: its contents changed after the save"
