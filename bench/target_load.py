"""How long a GGUF target takes to load: straight from the GGUF file (transformers dequantises
every tensor on every load) vs from TAPS's cached safetensors conversion (what `Target.load`
uses after the first time). Interleaved rounds, medians; not a test.

    python bench/target_load.py [--target smollm2-135m-instruct --rounds 3 --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from taps.core.target import Target
from taps.core.targets import find_gguf, load_gguf, resolve_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gguf = find_gguf(args.target)
    if gguf is None:
        raise SystemExit(f"{args.target} is not a GGUF target")
    t0 = time.perf_counter()
    resolve_target(args.target)  # converts on first use
    first = time.perf_counter() - t0
    dtype = getattr(torch, args.dtype)
    times: dict[str, list[float]] = {"gguf file": [], "cached safetensors": []}
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        load_gguf(gguf, dtype)
        times["gguf file"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        Target.load(args.target, device="cpu", dtype=args.dtype)
        times["cached safetensors"].append(time.perf_counter() - t0)
    print(f"target {args.target} ({gguf.name}, {gguf.stat().st_size / 1e6:.0f} MB), {args.dtype}, "
          f"{args.threads} thread(s), {args.rounds} interleaved rounds; resolve (converts if not cached): {first:.1f} s")
    base = statistics.median(times["gguf file"])
    print("| load from | median s | ratio to the GGUF load |\n| --- | ---: | ---: |")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.2f} | {statistics.median(values) / base:.2f} |")


if __name__ == "__main__":
    main()
