"""The package's layers, read from the source with `ast` (imports inside functions included): no two modules import
each other, however far round; the edge (lightning_dist/run/) is imported by nothing below it; the process lifecycle
(lightning_dist/lifecycle/) and the fence (lightning_dist/_compat/) import nothing above them."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "lightning_dist"
# What may import the edge: the edge itself, and the names configs written before it kept (launch/run_dir.py).
ABOVE_THE_EDGE = ("run", "launch")
# Each floor, and the floors it may import (besides itself).
FLOORS_BELOW = {"lifecycle": ("_compat",), "_compat": ()}


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module of `package` and the modules of it that it imports, at its top or anywhere inside."""
    modules = {module_name(path, package): path for path in package.rglob("*.py")}
    root = package.name

    def known(name: str) -> str:
        while name not in modules:  # a name imported from a module: the module
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {known(alias.name) for alias in node.names if alias.name.split(".")[0] == root}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] == root:
                imported |= {known(f"{node.module}.{alias.name}") for alias in node.names}
        graph[name] = imported - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, however far round (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:
        index[module] = lowest[module] = len(index)
        stack.append(module)
        for other in graph[module]:
            if other not in index:
                visit(other)
                lowest[module] = min(lowest[module], lowest[other])
            elif other in stack:
                lowest[module] = min(lowest[module], index[other])
        if lowest[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for module in graph:
        if module not in index:
            visit(module)
    return found


def floor(module: str) -> str:
    """The folder of the package a module is in, or "(root)"."""
    parts = module.split(".")[1:]
    return parts[0] if parts and (PACKAGE / parts[0]).is_dir() else "(root)"


def test_no_modules_import_each_other():
    assert circles(import_graph()) == []


def test_nothing_below_the_edge_imports_it():
    graph = import_graph()
    upward = sorted(f"{module} -> {other}" for module, imported in graph.items() for other in imported
                    if floor(other) == "run" and floor(module) not in ABOVE_THE_EDGE)
    assert upward == []


def test_the_lifecycle_and_the_fence_import_nothing_above_them():
    graph = import_graph()
    upward = sorted(f"{module} -> {other}" for module, imported in graph.items() for other in imported
                    if floor(module) in FLOORS_BELOW and floor(other) not in (floor(module), *FLOORS_BELOW[floor(module)]))
    assert upward == []


def test_the_checks_see_a_circle_through_a_lazy_import_and_an_arrow_up(tmp_path):
    package = tmp_path / "toy"
    (package / "lifecycle").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "lifecycle" / "__init__.py").write_text("")
    (package / "lifecycle" / "exits.py").write_text("def leave():\n    from toy.job import run\n")
    (package / "job.py").write_text("from toy.lifecycle.exits import leave\n")
    graph = import_graph(package)
    assert graph == {"toy": set(), "toy.lifecycle": set(), "toy.lifecycle.exits": {"toy.job"},
                     "toy.job": {"toy.lifecycle.exits"}}
    assert circles(graph) == [["toy.job", "toy.lifecycle.exits"]]


def test_the_package_root_holds_at_most_8_modules():
    root = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(root) <= 8, root


def test_the_names_configs_and_commands_used_before_the_move_still_load():
    from hydra.utils import get_object

    from lightning_dist import equivalence, sweep_report
    from lightning_dist.reports import equivalence as comparison, sweep_report as report
    from lightning_dist.reports.csv_log import ContinuingCSVLogger
    from lightning_dist.run.run_dir import OneRunPerDirectory

    assert get_object("lightning_dist.csv_log.ContinuingCSVLogger") is ContinuingCSVLogger
    assert get_object("lightning_dist.launch.run_dir.OneRunPerDirectory") is OneRunPerDirectory
    assert (sweep_report.main, equivalence.main) == (report.main, comparison.main)  # python -m lightning_dist.<name>


# The parts of the package that ask a strategy through its protocol (strategies/base.py) and never by its type.
ASK_BY_PROTOCOL = ("memory", "dry_run")


def type_switches(source: str) -> list[str]:
    """Each `isinstance(x, <...>Strategy)`, and each `hasattr`/`getattr` on a name `strategy`, in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args):
            continue
        if node.func.id == "isinstance" and len(node.args) == 2:
            kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            names = [kind.id if isinstance(kind, ast.Name) else getattr(kind, "attr", "") for kind in kinds]
            if any(name.endswith("Strategy") for name in names):
                found.append(f"{node.lineno}: {ast.get_source_segment(source, node)}")
        elif node.func.id in ("hasattr", "getattr") and isinstance(node.args[0], ast.Name) and node.args[0].id == "strategy":
            found.append(f"{node.lineno}: {ast.get_source_segment(source, node)}")
    return found


def test_the_planner_and_the_dry_run_ask_a_strategy_and_never_switch_on_its_type():
    switching = {str(path.relative_to(REPO)): found for folder in ASK_BY_PROTOCOL
                 for path in sorted((PACKAGE / folder).rglob("*.py")) if (found := type_switches(path.read_text()))}
    assert switching == {}
    source = ("if isinstance(strategy, (DDPStrategy, strategies.FSDPStrategy)): pass\n"
              "shards = hasattr(strategy, 'parallelize')\nbatch = isinstance(batch, dict)\n")
    assert [line.split(":")[0] for line in type_switches(source)] == ["1", "2"]
