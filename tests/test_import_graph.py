"""The package reads top-down: no module imports one of a higher layer, and no import cycle.

Layers, lowest first (docs/architecture.md):
  core     config, jsonl, outlock, outputs, identity, stopwatch, workers, tree, verify, kv, attention, machine,
           target_source, target, trace, decode, testing, and propose/base.py (the Proposer protocol: all that decode.py
           knows of drafting)
  drafter  drafter/*: the EAGLE head, its tree expansion, checkpoints; profile.py (auto-tree costs)
  propose  propose/*: the composition grammar (spec), single, routed, merged, lookup proposers, the factory
  data     data/*: readers, mixtures, chat encoding, regeneration, features
  train    train/*: losses, trainer, head families
  eval     eval/*: benchmarks, runner, records, metrics, report, drafter table
  study    study.py: the pipeline (target, drafters, eval, report); the only module that knows them all;
           beside it serve/*: the HTTP server (taps serve)
  cli      cli.py, cli_args.py, __main__.py and every */commands.py

Every `import` and `from ... import` counts, at module top or inside a function. Subpackage
`__init__.py` files import nothing from taps, so that importing one module never loads its siblings.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "taps"

LAYERS = ("core", "drafter", "propose", "data", "train", "eval", "study", "cli")
CORE = {"taps.config", "taps.jsonl", "taps.outlock", "taps.outputs", "taps.identity", "taps.stopwatch", "taps.workers",
        "taps.tree", "taps.verify", "taps.kv", "taps.attention", "taps.machine", "taps.target_source", "taps.target",
        "taps.trace", "taps.decode", "taps.testing", "taps.propose.base"}
CLI = {"taps.cli", "taps.cli_args", "taps.__main__"}
SUBPACKAGE_LAYERS = {"drafter": "drafter", "propose": "propose", "data": "data", "train": "train", "eval": "eval"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def is_package(name: str, mods: dict[str, Path]) -> bool:
    return mods[name].name == "__init__.py"


def layer(name: str) -> str:
    if name in CORE:
        return "core"
    if name in CLI or name.endswith(".commands"):
        return "cli"
    if name == "taps.study" or name.startswith("taps.serve."):  # the server sits beside the pipeline
        return "study"
    if name == "taps.profile":
        return "drafter"
    parts = name.split(".")
    if len(parts) >= 3 and parts[1] in SUBPACKAGE_LAYERS:
        return SUBPACKAGE_LAYERS[parts[1]]
    raise AssertionError(f"{name} has no layer: place it in tests/test_import_graph.py and docs/architecture.md")


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


def test_every_module_has_a_layer():
    for name in modules():
        if name == "taps" or is_package(name, modules()):
            continue
        assert layer(name) in LAYERS


def test_package_files_import_nothing_from_taps():
    mods = modules()
    edges = graph()
    loaded = {name: sorted(edges[name]) for name in mods if is_package(name, mods) and edges[name]}
    assert not loaded, f"package __init__ files that import taps modules: {loaded}"


def test_no_import_goes_up_a_layer():
    mods = modules()
    rank = {name: LAYERS.index(layer(name)) for name in mods if not is_package(name, mods)}
    upward = sorted(f"{a} ({layer(a)}) -> {b} ({layer(b)})" for a, targets in graph().items() if a in rank
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
    assert "taps.study" in imports("taps.eval.commands", mods)
    assert "taps.propose.base" in imports("taps.decode", mods)
    fake = tmp_path / "fake.py"  # the package itself imports taps modules at module top only
    fake.write_text("def f():\n    from taps.study import run_study\n    from ..tree import DraftTree\n")
    assert {"taps.study", "taps.tree"} <= imports("taps.eval.fake", {**mods, "taps.eval.fake": fake})
    assert LAYERS.index(layer("taps.cli")) > LAYERS.index(layer("taps.study")) > LAYERS.index(layer("taps.eval.runner"))
