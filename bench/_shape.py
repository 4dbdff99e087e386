"""The random target shared by the training benchmarks: a small Llama (hidden 256, 6 layers) unless told
otherwise (heads of 64 dims, FFN 2.75x hidden), built from command-line options."""

from __future__ import annotations

import argparse

import torch


def add_shape_args(ap: argparse.ArgumentParser, batch: int, steps: int) -> None:
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--threads", type=int, default=0)


def random_target(args: argparse.Namespace):
    """A random LlamaForCausalLM of the options' shape; also applies --threads."""
    from taps.core.testing import tiny_model

    if args.threads:
        torch.set_num_threads(args.threads)
    heads = max(1, args.hidden // 64)
    return tiny_model("llama", vocab_size=args.vocab, hidden_size=args.hidden, layers=args.layers, heads=heads,
                      kv_heads=heads, intermediate=int(args.hidden * 2.75), max_positions=4 * args.seq_len)
