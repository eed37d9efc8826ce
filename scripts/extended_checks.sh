#!/usr/bin/env bash
# The extended matrix: the cases of the suite's matrices it runs one per engine and checkpoint format of (every
# preset's curve, every cross-strategy resume pair, every precision cell, tensor-parallel layout, selective form,
# clipping path, real DeepSpeed config that trains), the rest of the two-node and fault-loop matrices, and the
# 7B ZeRO-3 dry run at 64 ranks. The README's suite deselects them (tests marked `extended`, `in_the_suite` in
# tests/conftest.py); about an hour on our 2-core machines.
#
#   bash scripts/extended_checks.sh [PYTEST ARGS]
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m pytest -m extended "$@"
