"""The import rule of docs/architecture.md, checked on the code: imports run downward only, and
no files import each other (directly or round a longer loop).

Every import of a project module counts, deferred ones inside functions included: a deferred
import changes when a module is loaded, not which layer depends on which.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

LAYERS: tuple[tuple[str, ...], ...] = (
    ("training.common",),
    ("training.spec", "training.instance_types", "training.network_cost", "training.prices"),
    ("training.data",),
    ("training.dataplane",),
    ("training.trainer",),
    ("training.processes", "training.costs"),
    ("training.launcher", "training.workstation", "training.local", "training.preflight"),
    ("training.planner", "training.rehearsal"),
    ("training.cli", "training.dataset_cli", "training.spec_cli"),
    ("infra",),
)
"""Lowest first: a module may import its own layer and those below it (docs/architecture.md)."""
GENERATED = "training/dataplane/v1/"


def _module(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def _modules() -> dict[str, Path]:
    files = [*REPO.joinpath("training").rglob("*.py"), *REPO.joinpath("infra").rglob("*.py")]
    return {_module(p): p for p in files if GENERATED not in p.relative_to(REPO).as_posix()}


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports (``from pkg import mod`` names the module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        found.update(n for n in names if n in modules and n not in ("training", "infra"))
    return found


def _layer(module: str) -> int:
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and docs/architecture.md")


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(p, modules) - {m} for m, p in modules.items()}


def test_every_module_has_a_layer(graph: dict[str, set[str]]) -> None:
    for module in graph:
        if module not in ("training", "infra"):
            _layer(module)


def test_imports_run_downward_only(graph: dict[str, set[str]]) -> None:
    upward = sorted(
        f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
        for m, targets in graph.items()
        if m not in ("training", "infra")
        for t in targets
        if _layer(t) > _layer(m)
    )
    assert not upward, "imports that run back up:\n" + "\n".join(upward)


def test_no_import_circles(graph: dict[str, set[str]]) -> None:
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        pytest.fail(f"import circle: {' -> '.join(e.args[1])}")


def test_the_rule_catches_what_it_names() -> None:
    """The checks themselves: an upward import and a two-file circle are found."""
    assert _layer("training.common.s3") < _layer("training.trainer.train")
    bad = {"training.common.s3": {"training.trainer.train"}, "training.trainer.train": set()}
    assert any(_layer(t) > _layer(m) for m, ts in bad.items() for t in ts)
    circle = {"a": {"b"}, "b": {"a"}}
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(circle).prepare()
