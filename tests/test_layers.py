"""Imports run downward (DESIGN.md, "Layers"): every module of diffrl/ imports only from its own
layer or below; `rollout/`, `train/` and `rewards/` never import each other; and no two packages
import each other in a circle, even within one layer.

The modules are parsed, not imported, so the test sees every import wherever it is written: at
module level, inside a function (the deferred imports that keep start-up fast), under
`TYPE_CHECKING`. A module named by a string is a dependency too: `importlib.import_module(...)`
and the tables that name modules to import later (`"diffrl.models.sd3:SD3Adapter"`), i.e. every
string constant, other than a docstring, that is exactly a dotted `diffrl.` path.

A failure names file:line of each import that breaks a rule. The fix is to move the code to the
layer it belongs to (what two layers both need goes to the lower one) or to invert the dependency
through a registry the upper layer fills, as a user's task would (DESIGN.md); there is no list of
exceptions.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "diffrl"

# DESIGN.md's order, top (1) to bottom (8): a module may import its own layer's or a larger number's.
# The package root (`diffrl/__init__.py`) is above them all: importing diffrl registers the built-in
# algorithms and rewards with the config, so it is the one module that imports layers above config.
LAYERS: dict[str, int] = {
    "__init__": 0,
    "cli": 1,
    "controller": 2,
    "workers": 3,
    "rollout": 4,
    "train": 4,
    "rewards": 4,
    "telemetry": 4,
    "data": 5,
    "toy": 5,
    "algos": 6,
    "transition": 6,
    "models": 6,
    "sde": 7,
    "schedules": 7,
    "config": 8,
    "registry": 8,
    "files": 8,
    "lazy": 8,
    "seeding": 8,
}
# Layer 4's three that meet only in workers/ (DESIGN.md).
APART = frozenset({"rollout", "train", "rewards"})
MODULE_PATH = re.compile(r"diffrl(\.\w+)+(:\w+)?")


@dataclass(frozen=True)
class Import:
    where: str  # file:line, relative to the repository root
    source: str  # the importing unit: a top-level package or module of diffrl ("config", "sde")
    target: str  # the imported unit
    text: str  # what is imported, as written ("diffrl.algos.spec", "diffrl.toy.model")


def unit_of(dotted: str) -> str:
    """`diffrl.a.b` -> `a`; `diffrl` -> `__init__`."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _docstrings(tree: ast.Module) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def imports_of(path: Path, package_dir: Path) -> list[Import]:
    """Every reference from the module at `path` to a module of the package, with its line."""
    rel = path.relative_to(package_dir.parent)
    module = ".".join(rel.with_suffix("").parts)
    package = module.removesuffix(".__init__") if path.name == "__init__.py" else module.rpartition(".")[0]
    source = unit_of(module) if path.name != "__init__.py" or "." in package else "__init__"
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package `level - 1` above this module's own
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            # `from diffrl import sde` imports the module diffrl.sde; `from diffrl.x import y`, x
            names = [f"{base}.{alias.name}" for alias in node.names] if base == "diffrl" else [base]
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and MODULE_PATH.fullmatch(node.value)
        ):
            names = [node.value.partition(":")[0]]
        for name in names:
            if name == "diffrl" or name.startswith("diffrl."):
                target = unit_of(name)
                if target.startswith("__") and target != "__init__":
                    continue  # the package's metadata (`from diffrl import __version__`), not a layer
                found.append(Import(f"{rel}:{node.lineno}", source, target, name))
    return found


def all_imports(package_dir: Path = PACKAGE_DIR) -> list[Import]:
    return [imp for path in sorted(package_dir.rglob("*.py")) for imp in imports_of(path, package_dir)]


def unmapped(imports: list[Import]) -> list[str]:
    """Top-level packages or modules the layer order does not place."""
    units = {imp.source for imp in imports} | {imp.target for imp in imports}
    return sorted(units - LAYERS.keys())


def upward(imports: list[Import]) -> list[str]:
    """Each import of a higher layer, or between two of rollout/train/rewards."""
    problems = []
    for imp in imports:
        if imp.source == imp.target or imp.source not in LAYERS or imp.target not in LAYERS:
            continue
        here, there = LAYERS[imp.source], LAYERS[imp.target]
        if there < here:
            problems.append(
                f"{imp.where}: {imp.source} (layer {here}) imports {imp.text} ({imp.target}, layer {there})"
            )
        elif {imp.source, imp.target} <= APART:
            problems.append(
                f"{imp.where}: {imp.source} imports {imp.text}: rollout, train and rewards never import "
                "each other (they meet in workers/)"
            )
    return problems


def circles(imports: list[Import]) -> list[str]:
    """Each import on a circle between units (a strongly connected component of more than one)."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.source != imp.target:
            graph.setdefault(imp.source, set()).add(imp.target)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = {start}, [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt == goal:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    return [
        f"{imp.where}: {imp.source} imports {imp.text}, and {imp.target} imports {imp.source} back "
        "(directly or through other packages)"
        for imp in imports
        if imp.source != imp.target and reaches(imp.target, imp.source)
    ]


def test_every_module_has_a_layer():
    assert unmapped(all_imports()) == [], "add the new package to DESIGN.md's layer order and to LAYERS"


def test_imports_run_only_downward():
    problems = upward(all_imports())
    assert not problems, "imports up the layer order (DESIGN.md):\n" + "\n".join(problems)


def test_no_two_packages_import_each_other():
    problems = circles(all_imports())
    assert not problems, "imports in a circle:\n" + "\n".join(problems)


@pytest.fixture
def made_up_package(tmp_path):
    """A package with one import of each kind the test must catch, at known lines."""
    pkg = tmp_path / "diffrl"
    files = {
        "__init__.py": "",
        "config/__init__.py": "",
        "config/schema.py": '"""diffrl.algos.spec is named in a docstring: not an import."""\n'
        "def validate():\n    from diffrl.algos import spec\n",  # function level, line 3
        "algos/__init__.py": "from diffrl.config.schema import validate\n",  # downward: fine
        "algos/spec.py": "",
        "models/__init__.py": 'BUILDERS = {"toy": "diffrl.toy.model:build"}\n',  # a string, line 1
        "toy/__init__.py": "",
        "toy/model.py": "from diffrl.models import BUILDERS\n",  # downward, but a circle with models
        "rollout/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from diffrl.train import x\n",
        "train/__init__.py": "from .. import sde\n",  # relative, downward
        "sde.py": "",
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    return pkg


def test_the_checks_find_each_kind_of_bad_import(made_up_package):
    imports = all_imports(made_up_package)
    assert upward(imports) == [
        "diffrl/config/schema.py:3: config (layer 8) imports diffrl.algos (algos, layer 6)",
        "diffrl/models/__init__.py:1: models (layer 6) imports diffrl.toy.model (toy, layer 5)",
        "diffrl/rollout/__init__.py:3: rollout imports diffrl.train: rollout, train and rewards never "
        "import each other (they meet in workers/)",
    ]
    assert [problem.split(":")[0] + ":" + problem.split(":")[1] for problem in circles(imports)] == [
        "diffrl/algos/__init__.py:1",
        "diffrl/config/schema.py:3",
        "diffrl/models/__init__.py:1",
        "diffrl/toy/model.py:1",
    ]
    assert {imp.text for imp in imports if imp.source == "train"} == {"diffrl.sde"}
    assert unmapped(imports) == []
