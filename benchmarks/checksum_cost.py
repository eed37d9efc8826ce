"""What proving a checkpoint whole costs: the manifest's CRC-32 (zlib) over a checkpoint-sized file, against
SHA-256 for scale.

    python benchmarks/checksum_cost.py              # 1 GiB, each 3 times; prints a table and the 1 s/GiB target
    python benchmarks/checksum_cost.py --gib 4

The file is read from the page cache (written, then read once before timing), as right after a save: the cost
measured is the checksum's, not the disk's. A save writes the manifest once (global rank 0); a resume checks it once.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time
from pathlib import Path

from lightning_dist.checkpoints.manifest import crc32_of

TARGET_S_PER_GIB = 1.0


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "shard.bin"
        with open(path, "wb") as file:
            for _ in range(int(args.gib * 1024)):
                file.write(os.urandom(1 << 20))
        crc32_of(path)  # into the page cache
        print(f"| checksum | seconds for {args.gib:g} GiB (median of {args.repeats}) | GiB/s |\n|---|---|---|")
        medians = {}
        for name, checksum in (("crc32 (zlib, the manifest's)", crc32_of), ("sha256 (for scale)", sha256_of)):
            times = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                checksum(path)
                times.append(time.perf_counter() - started)
            medians[name] = statistics.median(times)
            print(f"| {name} | {medians[name]:.2f} | {args.gib / medians[name]:.2f} |")
    per_gib = medians["crc32 (zlib, the manifest's)"] / args.gib
    print(f"\ncrc32: {per_gib:.2f} s per GiB (target {TARGET_S_PER_GIB:g} s): {'met' if per_gib <= TARGET_S_PER_GIB else 'MISSED'}")


if __name__ == "__main__":
    main()
