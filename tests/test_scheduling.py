"""The suite's own scheduling (tests/conftest.py): the groups it hands out first are groups that exist, so that a
module renamed or moved does not silently fall back to the end of the queue."""

from __future__ import annotations

from tests.conftest import LONGEST_FIRST, MEMORY_HEAVY, REPO, SHARED_RUN_GROUPS


def test_every_group_handed_out_first_is_a_group_or_a_test_module():
    groups = set(SHARED_RUN_GROUPS.values()) | set(MEMORY_HEAVY.values())
    modules = {".".join(path.relative_to(REPO).with_suffix("").parts) for path in (REPO / "tests").rglob("test_*.py")}
    assert [name for name in LONGEST_FIRST if name not in groups | modules] == []
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
