"""The package reads top-down: no module imports one of a higher layer, and no import cycle.

The folders are the layers. A module's layer is the first folder under `src/taps/` it sits in (a
top-level module is its own layer: `study.py`); the order of the layers, lowest first, is the
table "Layers, lowest first" of docs/architecture.md, which this file reads, so the two can not
drift apart. `__main__.py` belongs to the CLI.

Every `import` and `from ... import` counts, at module top or inside a function. Subpackage
`__init__.py` files import nothing from taps, so that importing one module never loads its siblings.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "taps"
ARCHITECTURE = SRC.parent / "docs" / "architecture.md"


def documented_layers() -> tuple[tuple[str, ...], ...]:
    """The rows of architecture.md's layer table, lowest first: each row names its folders (or the
    one top-level module) in back-quotes in its first cell, e.g. `core/` or `study.py`, `serve/`."""
    text = ARCHITECTURE.read_text()
    table = text[text.index("## Layers, lowest first"):].split("\n## ")[0]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 2 or cells[0] in ("layer", "---"):
            continue
        names = re.findall(r"`([\w.]+)/?`", cells[0])
        rows.append(tuple(n.removesuffix(".py") for n in names))
    return tuple(rows)


LAYERS = documented_layers()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def is_package(name: str, mods: dict[str, Path]) -> bool:
    return mods[name].name == "__init__.py"


def layer(name: str) -> int:
    """The rank of the module's folder in LAYERS (lowest first)."""
    parts = name.split(".")
    folder = "cli" if name == "taps.__main__" else parts[1]
    for rank, names in enumerate(LAYERS):
        if folder in names:
            return rank
    raise AssertionError(f"{name} sits in src/taps/{folder}, which is no layer: "
                         f"add it to the table of docs/architecture.md")


def imports(name: str, mods: dict[str, Path]) -> set[str]:
    """The taps modules `name` imports (a `from taps.x import y` names taps.x.y when that is a module)."""
    tree = ast.parse(mods[name].read_text(), filename=str(mods[name]))
    package = name if is_package(name, mods) else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                full = f"{source}.{alias.name}"
                found.add(full if full in mods else source)
    return {m for m in found if (m == "taps" or m.startswith("taps.")) and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    edges = {name: imports(name, mods) for name in mods}
    unknown = {f"{a} -> {b}" for a, targets in edges.items() for b in targets if b not in mods}
    assert not unknown, f"imports of modules that do not exist: {sorted(unknown)}"
    return edges


def test_every_folder_is_a_layer_and_every_layer_a_folder():
    assert LAYERS[0] == ("core",) and LAYERS[-1] == ("cli",), LAYERS
    folders = {p.name.removesuffix(".py") for p in PACKAGE.iterdir()
               if (p.is_dir() and (p / "__init__.py").is_file()) or (p.suffix == ".py" and p.stem not in ("__init__", "__main__"))}
    documented = {n for names in LAYERS for n in names}
    assert folders == documented, f"in src/taps but not in the table: {sorted(folders - documented)}; " \
                                  f"in the table but not in src/taps: {sorted(documented - folders)}"
    for name in modules():
        if name != "taps" and not is_package(name, modules()):
            layer(name)


def test_package_files_import_nothing_from_taps():
    mods = modules()
    edges = graph()
    loaded = {name: sorted(edges[name]) for name in mods if is_package(name, mods) and edges[name]}
    assert not loaded, f"package __init__ files that import taps modules: {loaded}"


def test_no_import_goes_up_a_layer():
    mods = modules()
    rank = {name: layer(name) for name in mods if not is_package(name, mods)}
    upward = sorted(f"{a} ({LAYERS[rank[a]]}) -> {b} ({LAYERS[rank[b]]})" for a, targets in graph().items() if a in rank
                    for b in targets if b in rank and rank[b] > rank[a])
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_import_cycle():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    cycles: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for nxt in sorted(edges[name]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[name] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checks_see_a_violation(tmp_path):
    """The graph parser finds function-level and relative imports (a check that sees nothing passes)."""
    mods = modules()
    assert "taps.study" in imports("taps.cli.eval", mods)
    assert "taps.core.proposer" in imports("taps.core.decode", mods)
    fake = tmp_path / "fake.py"  # the package itself imports taps modules at module top only
    fake.write_text("def f():\n    from taps.study import run_study\n    from ..core.tree import DraftTree\n")
    assert {"taps.study", "taps.core.tree"} <= imports("taps.eval.fake", {**mods, "taps.eval.fake": fake})
    assert layer("taps.cli.main") > layer("taps.study") > layer("taps.eval.runner") > layer("taps.core.decode")
    assert layer("taps.serve.app") == layer("taps.study") and layer("taps.__main__") == layer("taps.cli.main")
