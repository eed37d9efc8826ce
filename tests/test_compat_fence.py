"""Library internals stay behind one fence (lightning_dist/_compat/): read from the source with `ast`, no module
outside it imports or reads an underscored name of torch, Lightning, DeepSpeed or Hydra, or assigns to an attribute
of theirs (a monkeypatch). The fenced symbols themselves are checked to exist, with the signatures our patches were
written for: the canary that fails first when a library is upgraded."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
import textwrap

import pytest

from lightning_dist._compat import fenced, versions
from tests.conftest import REPO

pytestmark = pytest.mark.compat  # also run on the oldest and the newest torch (.ci/compat_tier)

PACKAGE = REPO / "lightning_dist"
FENCE = PACKAGE / "_compat"
LIBRARIES = ("torch", "lightning", "deepspeed", "hydra", "peft")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def crossings(source: str) -> list[str]:
    """Each place in `source` that reaches into a library's internals, as `line: code`."""
    tree = ast.parse(source)
    library_names: set[str] = set()  # names bound, in this module, to a library's modules or objects
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in LIBRARIES:
            library_names |= {alias.asname or alias.name for alias in node.names}
            if any(_private(part) for part in node.module.split(".")) or any(_private(a.name) for a in node.names):
                found.append(node)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in LIBRARIES:
                    library_names.add(alias.asname or alias.name.split(".")[0])
                    if any(_private(part) for part in alias.name.split(".")):
                        found.append(node)

    def reaches_library(node: ast.expr) -> bool:
        root = _root(node)
        return isinstance(root, ast.Name) and root.id in library_names

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and reaches_library(node):
            found.append(node)
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        found += [target for target in targets if isinstance(target, ast.Attribute) and reaches_library(target)]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            if node.args and reaches_library(node.args[0]):
                found.append(node)
    return sorted({f"{node.lineno}: {ast.get_source_segment(source, node)}" for node in found})


def test_no_module_outside_the_fence_reaches_into_a_library():
    outside = {
        str(path.relative_to(REPO)): found
        for path in sorted(PACKAGE.rglob("*.py"))
        if FENCE not in path.parents and (found := crossings(path.read_text()))
    }
    assert outside == {}


# Private attributes of other objects that are not the fenced libraries': transformers' initialiser hook, which its
# PreTrainedModel calls by this name (a model that has one initialises its weights only through it).
OTHER_LIBRARIES = {"_init_weights"}
# Public, documented names that start with an underscore: os._exit (leave without the interpreter's shutdown).
PUBLIC = {"_exit"}


def internal_attributes(source: str) -> list[str]:
    """Each `obj._name` read or written where `obj` is not `self`, `cls` or `super()` (a hook of the class we extend,
    overridden): another object's internals, whatever its type."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in OTHER_LIBRARIES | PUBLIC:
            owner = node.value
            own = isinstance(owner, ast.Name) and owner.id in ("self", "cls")
            parent = isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super"
            if not (own or parent):
                found.append(f"{node.lineno}: {ast.get_source_segment(source, node)}")
    return found


def test_no_module_outside_the_fence_reads_another_objects_internals():
    outside = {
        str(path.relative_to(REPO)): found
        for path in sorted(PACKAGE.rglob("*.py"))
        if FENCE not in path.parents and (found := internal_attributes(path.read_text()))
    }
    assert outside == {}
    source = "x = trainer._logger_connector\nself._launcher = super()._configure_launcher()\n"
    assert internal_attributes(source) == ["1: trainer._logger_connector"]


def test_the_check_sees_each_kind_of_crossing():
    source = (
        "import torch\n"
        "import deepspeed.utils.zero_to_fp32 as z\n"
        "from lightning.fabric.utilities.distributed import _set_num_threads_if_needed\n"
        "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper\n"
        "from torch.distributed import distributed_c10d\n"
        "supported = torch.ops.mkldnn._is_mkldnn_fp16_supported()\n"
        "merged = z._get_fp32_state_dict_from_zero3_checkpoint\n"
        "distributed_c10d.default_pg_timeout = 5\n"
        "setattr(torch.nn.functional, 'linear', print)\n"
        "self._launcher = None\n"  # our own object's attribute: not a library's
    )
    assert [line.split(":")[0] for line in crossings(source)] == ["3", "4", "6", "7", "8", "9"]


PRIVATE_NAME = re.compile(r"_[A-Za-z][A-Za-z0-9_]*[A-Za-z0-9]\.?")  # `_name` or `_name.`; not `_target_` (Hydra's key)


def private_name_strings(source: str) -> list[str]:
    """Each string that is a private name (`getattr(x, "_optimizer")`, a `"_forward_module."` prefix), where it does not
    name an attribute of our own object (`getattr(self, "_x")`): a library's internals passed as a string."""
    tree = ast.parse(source)
    own = {id(node.args[1]) for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
           and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1
           and isinstance(node.args[0], ast.Name) and node.args[0].id == "self"}
    own |= {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}  # f"{x}_y"
    return [f"{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and PRIVATE_NAME.fullmatch(node.value)
            and node.value not in OTHER_LIBRARIES and id(node) not in own]


def test_no_module_outside_the_fence_names_a_library_private_in_a_string():
    outside = {
        str(path.relative_to(REPO)): found
        for path in sorted(PACKAGE.rglob("*.py"))
        if FENCE not in path.parents and (found := private_name_strings(path.read_text()))
    }
    assert outside == {}
    source = ("a = getattr(optimizer, '_optimizer', optimizer)\nb = name.removeprefix('_forward_module.')\n"
              "c = getattr(self, '_mine', None)\nd = cfg['_target_']\ne = f'{stage}_loss'\n")
    assert private_name_strings(source) == ["1: '_optimizer'", "2: '_forward_module.'"]


def library_privates_used_by(cls: type, package: str = "lightning_dist.") -> set[str]:
    """The private names that the package's own classes among `cls`'s bases define, call, read or assign on `self` or
    `super()`, and that the first library class among its bases (Lightning's strategy) has too: on the class, or on
    an instance made with its defaults."""
    ours = [base for base in cls.__mro__ if base.__module__.startswith(package)]
    library = next(base for base in cls.__mro__ if not base.__module__.startswith(package))
    used = set()
    for base in ours:
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(base)))):
            if isinstance(node, ast.FunctionDef) and _private(node.name):
                used.add(node.name)
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                owner = node.value
                if (isinstance(owner, ast.Name) and owner.id == "self") or (
                        isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super"):
                    used.add(node.attr)
    return {name for name in used if hasattr(library, name) or name in vars(library())}


def test_the_check_sees_a_lightning_private_read_overridden_or_set():
    from lightning.pytorch.strategies import DDPStrategy

    class ReadsPrivates(DDPStrategy):
        def _setup_model(self, model):  # overridden
            self._own = self._ddp_kwargs  # read; ours
            super()._configure_launcher()  # called
            self._model_averager = None  # set

    assert library_privates_used_by(ReadsPrivates, package="tests.") == {
        "_setup_model", "_ddp_kwargs", "_configure_launcher", "_model_averager"}


@pytest.mark.parametrize("name", ["DDPStrategy", "FSDPStrategy", "DeepSpeedStrategy"])
def test_every_lightning_private_a_strategy_uses_is_fenced(name):
    import lightning_dist.strategies as strategies
    from lightning_dist._compat.lightning import INHERITED_PRIVATES

    strategy = getattr(strategies, name)
    library = next(base for base in strategy.__mro__ if not base.__module__.startswith("lightning_dist."))
    listed = INHERITED_PRIVATES[f"{library.__module__}.{library.__qualname__}"]
    assert sorted(library_privates_used_by(strategy) - set(listed)) == []
    instance = library()
    assert [private for private in listed if not (hasattr(library, private) or hasattr(instance, private))] == []


@pytest.mark.parametrize("symbol", fenced(), ids=lambda symbol: symbol.name)
def test_every_fenced_symbol_still_exists_as_checked(symbol):
    found = symbol.resolve()
    if symbol.parameters is not None:
        assert list(inspect.signature(found).parameters)[: len(symbol.parameters)] == list(symbol.parameters)


def test_installed_versions_are_the_supported_ones():
    assert versions.unsupported() == []


FAKE_VERSION = (
    "import importlib.metadata as metadata\n"
    "real = metadata.version\n"
    "metadata.version = lambda name: '0.18.1' if name == 'deepspeed' else real(name)\n"
    "import lightning_dist\n"
)


def test_an_unsupported_version_is_named_in_one_line_at_import():
    done = subprocess.run([sys.executable, "-c", FAKE_VERSION], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "lightning-dist" in line]
    supported = versions.requirements()["deepspeed"]
    assert lines == [f"lightning-dist: deepspeed 0.18.1 is installed; the supported versions are {supported}"
                     " (what its internals were checked on, lightning_dist/_compat)"]


def test_the_supported_versions_are_pinned_where_patches_depend_on_them():
    requirements = versions.requirements()
    assert requirements["deepspeed"] == "==0.19.8" and requirements["lightning"] == "==2.6.6"
    assert requirements["torch"] == ">=2.11,<2.16"  # the oldest and the newest: CI's compatibility tier
