"""Argument groups that several subcommands share, spelled once so their names and defaults agree."""

from __future__ import annotations

import argparse

DTYPES = ["auto", "float32", "bfloat16", "float16"]


def add_tree_arguments(p) -> None:
    """The EAGLE-2 tree shape (SPEC §2); defaults are the paper's 60/5/10."""
    p.add_argument("--total-tokens", type=int, default=60, help="tree budget, root included")
    p.add_argument("--depth", type=int, default=5, help="draft levels below the root")
    p.add_argument("--top-k", type=int, default=10, help="tree beam width / branching")


def add_device_arguments(p) -> None:
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (under accelerate: this process's)")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: bf16 on GPU, fp32 on CPU")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends an option's default to its help, except where there is none to show.

    argparse's own formatter writes "(default: None)" after options whose help already says what
    an unset value means (e.g. "(default: $TAPS_DATA_DIR)"), which reads as a contradiction.
    """

    def _get_help_string(self, action) -> str:
        if action.default is None or "(default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)
