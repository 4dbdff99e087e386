"""Tiny-target training step: cross-entropy alone vs cross-entropy + token-level unlikelihood,
side by side.

Not a test. Each timed step is one forward + loss + backward + AdamW step of a random target of the
tiny default's shape on random blocks; the objectives alternate so machine noise hits both alike.
Prints tokens/s of each and the cost ratio of the unlikelihood term.

    python bench/target_objective.py [--batch 4 --seq-len 512 --steps 5 --mixed-precision bf16 --threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _shape import add_shape_args, random_target  # noqa: E402
from taps.tiny.lm_objective import lm_loss  # noqa: E402
from taps.tiny.target_recipe import autocast  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(ap, batch=4, steps=5)
    ap.add_argument("--mixed-precision", choices=["no", "bf16"], default="bf16")
    args = ap.parse_args()

    device = torch.device("cpu")
    weights = {"cross-entropy": 0.0, "+ unlikelihood": 1.0}
    models = {name: random_target(args) for name in weights}
    optims = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=g)  # [B, T]
    times: dict[str, list[float]] = {name: [] for name in weights}
    for step in range(args.steps + 1):  # the first round is a warm-up
        for name, weight in weights.items():
            t0 = time.perf_counter()
            with autocast(device, args.mixed_precision):
                loss, _ = lm_loss(models[name](input_ids=x).logits, x, weight)
            loss.backward()
            optims[name].step()
            optims[name].zero_grad(set_to_none=True)
            if step:
                times[name].append(time.perf_counter() - t0)
    tokens = args.batch * args.seq_len
    tps = {name: tokens / statistics.median(ts) for name, ts in times.items()}
    print(f"shape: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; {args.batch} x {args.seq_len} "
          f"tokens per step, {args.mixed_precision} autocast, {torch.get_num_threads()} threads, median of {args.steps}")
    for name, value in tps.items():
        print(f"  {name:16s} {value:8.0f} tok/s")
    print(f"  unlikelihood costs {tps['cross-entropy'] / tps['+ unlikelihood']:.2f}x the time per token")


if __name__ == "__main__":
    main()
