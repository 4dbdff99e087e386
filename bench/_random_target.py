"""The random target and tree of the decoding benchmarks (decode_overhead.py, compose_cost.py):
its tree, device and thread options, and the model built from them. The tree options are the
`taps` command's own (cli_args.add_tree_arguments), with its defaults and checks."""

from __future__ import annotations

import argparse
import sys

import torch

from taps.cli.args import add_tree_arguments, speculation_from
from taps.core.config import TreeConfig
from taps.core.target import Target, resolve_device
from taps.core.testing import bench_model


def add_tree_device_args(ap: argparse.ArgumentParser) -> None:
    add_tree_arguments(ap)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = leave the default)")


def random_target(args: argparse.Namespace) -> tuple[torch.device, Target, TreeConfig]:
    """(device, the random target of --arch/--hidden/--layers/--vocab, the tree of the options)."""
    try:
        speculation = speculation_from(args)
    except ValueError as err:
        speculation, problem = None, str(err)
    else:
        problem = "--tree auto: this benchmark measures fixed trees; bench/decode_speed.py times auto ones" \
            if speculation.auto else None
    if problem:
        print(problem, file=sys.stderr)
        sys.exit(2)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    target = Target(bench_model(args.arch, args.hidden, args.layers, args.vocab).to(device))
    return device, target, speculation.tree
