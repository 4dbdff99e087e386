"""bench/ scripts run against the installed package (`pip install -e .`) and take its definitions:
no sys.path patching, the `taps` command's own tree options, no tree shape of their own where the
package has one."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(BENCH.glob("*.py"))


def test_no_script_patches_the_import_path():
    assert len(SCRIPTS) >= 5
    for script in SCRIPTS:
        tree = ast.parse(script.read_text(), str(script))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                assert (node.value.id, node.attr) != ("sys", "path"), f"{script.name}:{node.lineno} patches sys.path"


def test_tree_options_are_the_commands_own():
    for script in SCRIPTS:
        text = script.read_text()
        assert '"--total-tokens"' not in text and '"--depth"' not in text, \
            f"{script.name} declares tree options of its own; use taps.cli.args.add_tree_arguments"
        assert "TreeConfig(60, 5, 10)" not in text and "TreeConfig(96, 8, 8)" not in text, \
            f"{script.name} re-declares a tree the package defines (config.FIXED_TREE, config.AUTO_TREE_CAPS)"
