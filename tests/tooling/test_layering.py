"""The package's layers point one way, and no package reaches into another's privates.

Read from the source with :mod:`ast` (nothing is imported), so a violation fails here
whether or not any test exercises the importing code path. The order, top to bottom:

    loop -> checkpointer -> {snapshot, store, state, sampler} -> distributed -> errors

with ``snapshot`` above ``store`` (snapshots are kept in the store's format) and
``state`` above ``store`` too (TrainState checks its extras with the store's one
validator, so what it builds is what the store saves). The root
package's own modules (``__init__``, ``cli``, ``run``, ``__main__``) and ``testing``
sit above everything; ``_version``, ``_console``, ``_env``, ``_agent`` (which
process is a torchrun agent) and ``_checks`` (the shared argument checks) below
everything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "elastic_kit"

#: What each unit may import (besides itself and the base modules).
ALLOWED: dict[str, frozenset[str]] = {
    "loop": frozenset({"checkpointer", "health", "snapshot", "store", "state", "sampler",
                       "distributed", "errors"}),
    "checkpointer": frozenset({"health", "snapshot", "store", "state", "sampler", "distributed",
                               "errors"}),
    "health": frozenset({"distributed", "errors"}),
    "snapshot": frozenset({"store", "distributed", "errors"}),
    "store": frozenset({"distributed", "errors"}),
    "state": frozenset({"store", "distributed", "errors"}),
    "sampler": frozenset({"distributed", "errors"}),
    "distributed": frozenset({"_collectives", "errors"}),
    "_collectives": frozenset({"errors"}),  # distributed's collectives, in their own module
    "errors": frozenset(),
    "_version": frozenset(),
    "_console": frozenset(),
    "_env": frozenset(),
    "_agent": frozenset(),
    "_checks": frozenset(),
}
BASE = frozenset({"_version", "_console", "_env", "_agent", "_checks"})
TOP = frozenset({"__init__", "__main__", "cli", "run", "testing"})


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _unit(module: str) -> str:
    """``elastic_kit.store._layout`` -> ``store``; ``elastic_kit`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every import of an ``elastic_kit`` module or name."""
    module = _module_name(path)
    is_pkg = path.name == "__init__.py"
    package = module if is_pkg else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found.append((node.lineno, source))
            # ``from elastic_kit.store import _layout`` names a private module too
            found += [(node.lineno, f"{source}.{a.name}") for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")
                      and _is_module(f"{source}.{a.name}")]
    return [(line, name) for line, name in found
            if name == "elastic_kit" or name.startswith("elastic_kit.")]


def violations() -> list[str]:
    bad: list[str] = []
    for path in sorted(PKG.rglob("*.py")):
        importer = _module_name(path)
        unit = _unit(importer)
        where = path.relative_to(ROOT)
        for line, target in _imports(path):
            parts = target.split(".")
            # a private module is importable from inside the package that holds it
            for i, part in enumerate(parts[1:], start=1):
                owner = ".".join(parts[:i])
                if part.startswith("_") and not part.startswith("__") and not (
                        importer == owner or importer.startswith(owner + ".")):
                    bad.append(f"{where}:{line}: imports {target}, private to {owner}")
                    break
            if unit in TOP:
                continue
            target_unit = _unit(target)
            if target_unit in (unit, *BASE):
                continue
            if target_unit not in ALLOWED.get(unit, frozenset()):
                bad.append(f"{where}:{line}: {unit} imports {target}, which is not below it")
    return bad


def test_no_import_reaches_into_another_package_or_points_up() -> None:
    assert violations() == []


@pytest.mark.parametrize("source, expected", [
    ("from elastic_kit.store._layout import Layout\n", "private to elastic_kit.store"),
    ("from elastic_kit.store import _layout\n", "private to elastic_kit.store"),
    ("from elastic_kit.loop import ElasticLoop\n", "snapshot imports elastic_kit.loop"),
    ("from ..checkpointer import Checkpointer\n", "snapshot imports elastic_kit.checkpointer"),
])
def test_the_check_catches_each_kind_of_violation(tmp_path, monkeypatch, source: str,
                                                  expected: str) -> None:
    """The checker itself, on a copy of the package with one bad import planted."""
    import shutil

    root = tmp_path / "repo"
    shutil.copytree(PKG, root / "elastic_kit",
                    ignore=shutil.ignore_patterns("__pycache__"))
    planted = root / "elastic_kit" / "snapshot" / "_planted.py"
    planted.write_text(source)
    monkeypatch.setattr(f"{__name__}.ROOT", root)
    monkeypatch.setattr(f"{__name__}.PKG", root / "elastic_kit")
    found = violations()
    assert any("_planted.py" in v and expected in v for v in found), found
