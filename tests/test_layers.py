"""The packages' layers (docs/design.md, section 6): every import of an mhgpo module, at the top of a file or inside a
function, goes to the importer's own layer or one below it."""

from __future__ import annotations

import ast
from pathlib import Path

import mhgpo

PACKAGE = Path(mhgpo.__file__).parent

# bottom first; the modules of one layer may import each other
LAYERS = [
    {"errors", "io", "paths"},
    {"config"},
    {"data"},
    {"retrieval"},
    {"model"},
    {"team"},
    {"runtime"},
    {"rl"},
    {"run"},
    {"experiments"},
    {"cli", "api", "__main__", "__init__"},
]


def layer(part: str) -> int:
    """The layer of `mhgpo.<part>...` (`__init__`: the package itself)."""
    return next(i for i, names in enumerate(LAYERS) if part in names)


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, the first name under `mhgpo`) of each import of an mhgpo module in the file at `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "mhgpo" else [f"mhgpo.{a.name}" for a in node.names]
        else:
            assert not (isinstance(node, ast.ImportFrom) and node.level), f"{path}: a relative import"
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "mhgpo":
                found.append((node.lineno, parts[1] if len(parts) > 1 else "__init__"))
    return found


def test_every_package_is_in_a_layer() -> None:
    tops = {
        p.stem if p.is_file() else p.name
        for p in PACKAGE.iterdir()
        if p.suffix == ".py" or (p / "__init__.py").exists()
    }
    assert tops == set().union(*LAYERS)


def test_imports_only_go_down_the_layers() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        own = layer(rel.parts[0] if len(rel.parts) > 1 else rel.stem)
        for line, part in imported(path):
            if layer(part) > own:
                upward.append(f"mhgpo/{rel.as_posix()}:{line} imports mhgpo.{part}")
    assert upward == []
