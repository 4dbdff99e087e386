"""The random target and tree of the decoding benchmarks (decode_overhead.py, compose_cost.py):
its tree, device and thread options, and the model built from them."""

from __future__ import annotations

import argparse

import torch

from taps.config import TreeConfig
from taps.target import Target, resolve_device
from taps.testing import bench_model


def add_tree_device_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--total-tokens", type=int, default=60)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = leave the default)")


def random_target(args: argparse.Namespace) -> tuple[torch.device, Target, TreeConfig]:
    """(device, the random target of --arch/--hidden/--layers/--vocab, the tree of the options)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    target = Target(bench_model(args.arch, args.hidden, args.layers, args.vocab).to(device))
    return device, target, TreeConfig(args.total_tokens, args.depth, args.top_k)
