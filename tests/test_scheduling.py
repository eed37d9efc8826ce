"""The suite's own scheduling (tests/conftest.py): the groups it hands out first are groups that exist, so that a
module renamed or moved does not silently fall back to the end of the queue; a module's tests stay in one worker
unless they share nothing."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace

import pytest

from tests.conftest import LONGEST_FIRST, MEMORY_HEAVY, REPO, SHARED_RUN_GROUPS, pytest_collection_modifyitems


def test_every_group_handed_out_first_is_a_group_or_a_test_module():
    groups = set(SHARED_RUN_GROUPS.values()) | set(MEMORY_HEAVY.values())
    modules = {".".join(path.relative_to(REPO).with_suffix("").parts) for path in (REPO / "tests").rglob("test_*.py")}
    assert [name for name in LONGEST_FIRST if name not in groups | modules] == []
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)


class CollectedTest:
    """What the grouping reads of a collected test, and the markers it adds."""

    def __init__(self, module: ModuleType, name: str) -> None:
        self.module, self.nodeid, self.fixturenames, self.groups = module, f"{module.__name__}::{name}", [], []

    def get_closest_marker(self, name: str) -> None:
        return None

    def add_marker(self, marker) -> None:
        self.groups += marker.args


def test_a_modules_tests_share_its_worker_unless_they_share_nothing():
    together, apart = ModuleType("tests.test_together"), ModuleType("tests.test_apart")
    apart.TESTS_SHARE_NOTHING = True
    items = [CollectedTest(module, name) for module in (together, apart) for name in ("test_a", "test_b")]
    config = SimpleNamespace(pluginmanager=SimpleNamespace(has_plugin=lambda name: True), getoption=lambda name: "")
    pytest_collection_modifyitems(config, items)
    assert [item.groups for item in items] == [["tests.test_together"], ["tests.test_together"],
                                               ["tests.test_apart::test_a"], ["tests.test_apart::test_b"]]


def test_a_compat_test_in_a_file_the_tier_does_not_pass_pytest_stops_the_collection(tmp_path, monkeypatch):
    """.ci/compat_tier passes pytest the files whose text has `mark.compat`: a test marked otherwise would not run
    on the tier's torches."""
    monkeypatch.setattr("tests.conftest.REPO", tmp_path)
    module = ModuleType("tests.test_marked_by_getattr")
    item = CollectedTest(module, "test_a")
    item.path = tmp_path / "tests" / "test_marked_by_getattr.py"
    item.path.parent.mkdir()
    item.path.write_text('import pytest\npytestmark = getattr(pytest.mark, "compat")\n')
    item.get_closest_marker = lambda name: name == "compat" or None
    config = SimpleNamespace(pluginmanager=SimpleNamespace(has_plugin=lambda name: False), getoption=lambda name: "")
    with pytest.raises(pytest.exit.Exception, match=r"^tests/test_marked_by_getattr\.py: tests marked compat where"):
        pytest_collection_modifyitems(config, [item])
    item.path.write_text("import pytest\npytestmark = pytest.mark.compat\n")
    pytest_collection_modifyitems(config, [item])  # the tier finds it: no stop
