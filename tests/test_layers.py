"""The package's layers, read from the source with `ast` (imports inside functions included): no two modules import
each other, however far round, and no import goes up a layer. From the top: the edge (the run, its command line and
the names kept for old configs), the strategies with their engine slices, the floors that name no engine, the process
lifecycle, and the fence round the libraries (lightning_dist/_compat/)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "lightning_dist"
# Top to bottom; a module imports its own layer's modules and those of the layers below, never one above.
LAYERS = (
    ("the edge", ("(root)", "run", "launch")),  # launch/: the names configs written before run/ existed kept
    ("the strategies", ("strategies",)),
    ("the floors", ("dry_run", "callbacks", "data", "models", "optim", "reports", "parallel", "memory", "checkpoints")),
    ("the lifecycle", ("lifecycle",)),
    ("the fence", ("_compat",)),
)


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


def layer(floor_name: str) -> int:
    return next(depth for depth, (_, floors) in enumerate(LAYERS) if floor_name in floors)


def arrows_up(graph: dict[str, set[str]], floor_of=floor) -> list[str]:
    """Each import of a module in a layer above the importing one's."""
    return sorted(f"{module} -> {other} ({LAYERS[layer(floor_of(other))][0]})" for module, imported in graph.items()
                  for other in imported if layer(floor_of(other)) < layer(floor_of(module)))


def test_every_folder_of_the_package_is_in_a_layer():
    folders = {path.name for path in PACKAGE.iterdir() if path.is_dir() and any(path.rglob("*.py"))} | {"(root)"}
    assert folders == {name for _, floors in LAYERS for name in floors}


def test_no_import_goes_up_a_layer():
    assert arrows_up(import_graph()) == []


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
    assert arrows_up(graph, floor_of=lambda module: "lifecycle" if "lifecycle" in module else "(root)") == [
        "toy.lifecycle.exits -> toy.job (the edge)"
    ]


def test_the_package_root_holds_at_most_8_modules():
    root = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(root) <= 8, root


def test_the_names_configs_and_commands_used_before_the_move_still_load():
    from hydra.utils import get_object

    from lightning_dist import equivalence, sweep_report
    from lightning_dist.reports import equivalence as comparison
    from lightning_dist.reports import sweep_report as report
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


def engine_label_reads(source: str) -> list[str]:
    """Each read of an `engine` attribute (a layout's or a view's label) in `source`."""
    return [f"{node.lineno}: {ast.get_source_segment(source, node)}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr == "engine" and isinstance(node.ctx, ast.Load)]


def test_the_planner_and_the_dry_run_read_what_an_engine_does_never_its_name():
    """A layout says how its engine keeps state (fp32 master weights, bucket rebuilds, ...) and a rank view which
    plan category each tracker category is: nothing below the strategies branches on which engine it is."""
    reading = {str(path.relative_to(REPO)): found for folder in ASK_BY_PROTOCOL
               for path in sorted((PACKAGE / folder).rglob("*.py")) if (found := engine_label_reads(path.read_text()))}
    assert reading == {}
    assert [line.split(":")[0] for line in engine_label_reads("if layout.engine == 'x': layout.engine = 'y'\n")] == ["1"]


# The engines the strategies' slices hold. Below them, no module imports an engine or names an engine's type; DeepSpeed's
# checkpoint files are read with `zero_to_fp32`, the converter DeepSpeed ships (and copies into every checkpoint) to
# read them without an engine, or through the fence.
ENGINE_PACKAGES = ("deepspeed", "torch.distributed.fsdp")
ENGINE_FREE_READERS = ("deepspeed.utils.zero_to_fp32",)
ENGINE_TYPES = {"DeepSpeedEngine", "DeepSpeedStrategy", "DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3",
                "FSDPModule", "FullyShardedDataParallel", "FSDPStrategy", "fully_shard"}


def engine_names(source: str) -> list[str]:
    """Each import of an engine's package, and each use of an engine's type, in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        modules = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules = [node.module]
        named = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        if any(module.startswith(ENGINE_PACKAGES) and not module.startswith(ENGINE_FREE_READERS) for module in modules):
            found.append(f"{node.lineno}: import {', '.join(modules)}")
        elif named in ENGINE_TYPES:
            found.append(f"{node.lineno}: {named}")
    return found


def test_nothing_below_the_strategies_imports_an_engine_or_names_its_types():
    below = [floor_name for _, floors in LAYERS[2:-1] for floor_name in floors]  # the floors and the lifecycle
    naming = {str(path.relative_to(REPO)): found for folder in below
              for path in sorted((PACKAGE / folder).rglob("*.py")) if (found := engine_names(path.read_text()))}
    assert naming == {}
    source = ("import deepspeed\nfrom torch.distributed.fsdp import FSDPModule\n"
              "from deepspeed.utils.zero_to_fp32 import get_model_state_files\n"
              "def f(engine):\n    return isinstance(engine, deepspeed.DeepSpeedEngine)\n")
    assert [line.split(":")[0] for line in engine_names(source)] == ["1", "2", "5"]
