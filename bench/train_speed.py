"""Drafter training throughput: EAGLE-2 vs HASS tokens/s on a random target, side by side.

Not a test. Each timed step is one loss + backward + AdamW step of the head on a batch of target
features (computed by the target once, outside the timing); the backbones alternate so machine
noise hits both alike. Prints tokens/s per backbone and the HASS / EAGLE-2 cost per token.

    python bench/train_speed.py [--hidden 256 --layers 6 --vocab 8192 --seq-len 512 --batch 4 --steps 6]
                                [--mixed-precision bf16]

--mixed-precision bf16 times the steps under bf16 autocast, as `taps train --mixed-precision bf16`
(and the embedded default's drafter build) runs them; the ratio it prints sets the cost model that
the drafter family (`taps reproduce`, drafters.jobs) balances heads with (taps/train/family.py: HASS_COST).

--compile also times both backbones with the loss's vocabulary-sized terms torch.compile'd
(`taps train --compile`), interleaved with the eager ones, and prints compiled / eager speedups.
The one-off compile happens in the warm-up round, outside the timing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from taps.drafter.checkpoint import init_head
from taps.core.target import Target
from taps.train.losses import Eagle2Config, HassConfig, TrainBatch, eagle2_loss, hass_loss

from _shape import add_shape_args, random_target  # beside this script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(ap, batch=4, steps=6)
    ap.add_argument("--hass-steps", type=int, default=3)
    ap.add_argument("--mixed-precision", choices=("no", "bf16"), default="no")
    ap.add_argument("--compile", action="store_true", help="also time the compiled loss, side by side")
    args = ap.parse_args()
    model = random_target(args)
    target = Target(model)
    model.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=g)  # [B, T]
    batch = TrainBatch(input_ids=ids, hidden=target.encode(ids).float().clone(), loss_mask=torch.ones_like(ids),
                       lengths=torch.full((args.batch,), args.seq_len))
    # as the trainer runs them: no top-1 metric on training steps
    runs = {"eagle2": (eagle2_loss, Eagle2Config(top1=False)), "hass": (hass_loss, HassConfig(steps=args.hass_steps, top1=False))}
    if args.compile:
        runs.update({"eagle2+c": (eagle2_loss, Eagle2Config(top1=False, compile=True)),
                     "hass+c": (hass_loss, HassConfig(steps=args.hass_steps, top1=False, compile=True))})
    heads_by = {name: init_head(model.config, seed=0).bind(target.embed_tokens, target.lm_head) for name in runs}
    optims = {name: torch.optim.AdamW(h.parameters(), lr=1e-4) for name, h in heads_by.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for step in range(args.steps + 1):  # the first round is a warm-up
        for name, (fn, cfg) in runs.items():
            t0 = time.perf_counter()
            with torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=args.mixed_precision == "bf16"):
                out = fn(heads_by[name], batch, cfg, generator=torch.Generator().manual_seed(step))
            out.loss.backward()
            optims[name].step()
            optims[name].zero_grad(set_to_none=True)
            if step:
                times[name].append(time.perf_counter() - t0)
    tokens = args.batch * args.seq_len
    n_head = sum(p.numel() for p in heads_by["eagle2"].parameters()) / 1e6
    print(f"target: random llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; head {n_head:.2f}M "
          f"parameters; batch {args.batch} x {args.seq_len} tokens; threads {torch.get_num_threads()}; "
          f"{args.steps} timed steps each, interleaved; mixed precision {args.mixed_precision}")
    tps = {name: tokens / statistics.median(t) for name, t in times.items()}
    for name in runs:
        print(f"{name:<8} {tps[name]:>9.0f} tokens/s   {1e3 * statistics.median(times[name]):>8.1f} ms/step")
    print(f"HASS / EAGLE-2 cost per token: {tps['eagle2'] / tps['hass']:.2f}x (HASS runs {args.hass_steps} aligned steps)")
    if args.compile:
        print(f"compiled / eager: EAGLE-2 {tps['eagle2+c'] / tps['eagle2']:.2f}x, HASS {tps['hass+c'] / tps['hass']:.2f}x "
              f"(HASS / EAGLE-2 compiled: {tps['eagle2+c'] / tps['hass+c']:.2f}x)")


if __name__ == "__main__":
    main()
