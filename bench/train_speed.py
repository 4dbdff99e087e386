"""Drafter training throughput: EAGLE-2, HASS and EAGLE-3 tokens/s on a random target, side by side.

Not a test. Each timed step is one loss + backward + AdamW step of the head on a batch of target
features (computed by the target once, outside the timing); the backbones alternate so machine
noise hits both alike. Prints tokens/s per backbone and the HASS / EAGLE-2 cost per token.

    python bench/train_speed.py [--hidden 256 --layers 6 --vocab 8192 --seq-len 512 --batch 4 --steps 6]
                                [--mixed-precision bf16] [--backbones eagle2,hass,eagle3] [--dense]
                                [--draft-vocab 8192]

--mixed-precision bf16 times the steps under bf16 autocast, as `taps train --mixed-precision bf16`
(and the embedded default's drafter build) runs them; the ratio it prints sets the cost model that
the drafter family (`taps reproduce`, drafters.jobs) balances heads with (taps/train/family.py: HASS_COST).

--backbones picks which of eagle2, hass, eagle3 run (EAGLE-3: `--eagle3-steps` training-time test
steps over three random "target layers"). --dense also times HASS and EAGLE-3 with their aligned
steps' attention over every step's rows under the dense mask (the path train/band_attention.py
replaces), interleaved, and prints band / dense speedups.

--compile also times both backbones with the loss's vocabulary-sized terms torch.compile'd
(`taps train --compile`), interleaved with the eager ones, and prints compiled / eager speedups.
The one-off compile happens in the warm-up round, outside the timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
import unittest.mock
from contextlib import nullcontext

import torch

from taps.drafter.checkpoint import init_head
from taps.core.target import Target
from taps.train import losses
from taps.train.losses import Eagle2Config, Eagle3Config, HassConfig, TrainBatch, eagle2_loss, eagle3_loss, hass_loss

from _shape import add_shape_args, random_target  # beside this script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(ap, batch=4, steps=6)
    ap.add_argument("--hass-steps", type=int, default=3)
    ap.add_argument("--eagle3-steps", type=int, default=7)
    ap.add_argument("--backbones", default="eagle2,hass", help="comma-separated: eagle2, hass, eagle3")
    ap.add_argument("--draft-vocab", type=int, default=0, help="heads draft over the first N ids (0: all)")
    ap.add_argument("--dense", action="store_true", help="also time HASS / EAGLE-3 with the dense-mask attention")
    ap.add_argument("--mixed-precision", choices=("no", "bf16"), default="no")
    ap.add_argument("--compile", action="store_true", help="also time the compiled loss, side by side")
    args = ap.parse_args()
    model = random_target(args)
    target = Target(model)
    model.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=g)  # [B, T]
    hidden = target.encode(ids).float().clone()  # [B, T, H]
    aux = torch.randn(args.batch, args.seq_len, 3 * args.hidden, generator=g)  # [B, T, 3H] stand-in layers
    batch = TrainBatch(input_ids=ids, hidden=hidden, loss_mask=torch.ones_like(ids),
                       lengths=torch.full((args.batch,), args.seq_len), aux=aux)
    plain = TrainBatch(input_ids=ids, hidden=hidden, loss_mask=batch.loss_mask, lengths=batch.lengths)
    # as the trainer runs them: no top-1 metric on training steps
    every = {"eagle2": (eagle2_loss, Eagle2Config(top1=False)),
             "hass": (hass_loss, HassConfig(steps=args.hass_steps, top1=False)),
             "eagle3": (eagle3_loss, Eagle3Config(steps=args.eagle3_steps, top1=False))}
    chosen = args.backbones.split(",")
    unknown = sorted(set(chosen) - set(every))
    if unknown:
        ap.error(f"--backbones: unknown {unknown}; choose from {sorted(every)}")
    runs = {name: every[name] for name in chosen}
    if args.dense:
        runs.update({f"{name}-dense": runs[name] for name in ("hass", "eagle3") if name in runs})
    if args.compile:
        runs.update({f"{name}+c": (fn, dataclasses.replace(cfg, compile=True))
                     for name, (fn, cfg) in list(runs.items()) if not name.endswith("-dense")})

    draft_ids = torch.arange(args.draft_vocab) if args.draft_vocab else None

    def head_for(name: str):
        if name.startswith("eagle3"):
            head = init_head(model.config, seed=0, backbone="eagle3", draft_vocab_size=args.draft_vocab or None)
        else:
            head = init_head(model.config, seed=0)
        return head.bind(target.embed_tokens, target.lm_head).set_draft_vocab(draft_ids)

    def dense_attention(name: str):  # the aligned steps under the dense mask, for the -dense runs
        if not name.endswith("-dense"):
            return nullcontext()
        return unittest.mock.patch.object(losses, "aligned_outputs",
                                          functools.partial(losses.aligned_outputs, dense=True))

    heads_by = {name: head_for(name) for name in runs}
    optims = {name: torch.optim.AdamW(h.parameters(), lr=1e-4) for name, h in heads_by.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for step in range(args.steps + 1):  # the first round is a warm-up
        for name, (fn, cfg) in runs.items():
            t0 = time.perf_counter()
            with torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=args.mixed_precision == "bf16"), \
                    dense_attention(name):
                out = fn(heads_by[name], batch if name.startswith("eagle3") else plain, cfg,
                         generator=torch.Generator().manual_seed(step))
            out.loss.backward()
            optims[name].step()
            optims[name].zero_grad(set_to_none=True)
            if step:
                times[name].append(time.perf_counter() - t0)
    tokens = args.batch * args.seq_len
    n_head = sum(p.numel() for p in next(iter(heads_by.values())).parameters()) / 1e6
    print(f"target: random llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; head {n_head:.2f}M "
          f"parameters; batch {args.batch} x {args.seq_len} tokens; threads {torch.get_num_threads()}; "
          f"{args.steps} timed steps each, interleaved; mixed precision {args.mixed_precision}")
    tps = {name: tokens / statistics.median(t) for name, t in times.items()}
    for name in runs:
        print(f"{name:<13} {tps[name]:>9.0f} tokens/s   {1e3 * statistics.median(times[name]):>8.1f} ms/step")
    if "eagle2" in tps:
        for name, steps in (("hass", args.hass_steps), ("eagle3", args.eagle3_steps)):
            if name in tps:
                print(f"{name} / eagle2 cost per token: {tps['eagle2'] / tps[name]:.2f}x ({steps} aligned steps)")
    for name in ("hass", "eagle3"):
        if f"{name}-dense" in tps:
            print(f"{name}: band / dense attention: {tps[name] / tps[f'{name}-dense']:.2f}x tokens/s")
    for name in chosen:
        if f"{name}+c" in tps:
            print(f"{name}: compiled / eager: {tps[f'{name}+c'] / tps[name]:.2f}x")


if __name__ == "__main__":
    main()
