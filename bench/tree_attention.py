"""One layer's attention in a verify forward, the two ways TAPS has computed it, on random tensors.

Not a test. For each committed context and tree size it prints the median ms of
  dense   the library's SDPA attention with the dense additive mask [1, 1, N, prefix + N] (what a
          verify forward ran before taps.core.attention: with a mask the grouped keys are copied out
          to every query head and the masked flash kernel runs)
  tree    taps.core.attention.tree_attention (the prefix unmasked, the N x N ancestor mask on the tree
          block, no key copies)
and checks that both give the same output. The shape defaults to SmolLM2-135M's (9 query heads over
3 key heads of 64 dims); the tree is a chain (its shape barely changes the cost).

    python bench/tree_attention.py [--contexts 100,1500,2048 --nodes 1,16,64 --dtype bfloat16
        --threads 1 --heads 9 --kv-heads 3 --head-dim 64 --repeats 50]
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from taps.core.attention import ALL_ATTENTION_FUNCTIONS, TreeBlock, tree_attention


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="100,1500,2048")
    ap.add_argument("--nodes", default="1,16,64")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    module = SimpleNamespace(num_key_value_groups=args.heads // args.kv_heads, is_causal=True, training=False)
    scale = args.head_dim ** -0.5
    gen = torch.Generator().manual_seed(0)
    print(f"one layer's attention, {args.heads} query heads over {args.kv_heads} key heads of {args.head_dim}, "
          f"{args.dtype}, {args.threads} thread(s); median of {args.repeats}")
    print("| committed context | tree nodes | dense mask ms | tree path ms | dense / tree | max abs diff |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for prefix in map(int, args.contexts.split(",")):
        for n in map(int, args.nodes.split(",")):
            q = torch.randn(1, args.heads, n, args.head_dim, generator=gen).to(dtype)  # [1, H, N, D]
            k = torch.randn(1, args.kv_heads, prefix + n, args.head_dim, generator=gen).to(dtype)  # [1, Hkv, P + N, D]
            v = torch.randn(1, args.kv_heads, prefix + n, args.head_dim, generator=gen).to(dtype)
            block = TreeBlock(torch.ones(n, n, dtype=torch.bool).tril(), torch.arange(n), prefix)
            mask = block.dense_mask(None, dtype)  # [1, 1, N, P + N]
            with torch.inference_mode():
                dense_out = sdpa(module, q, k, v, mask, scaling=scale)[0]
                tree_out = tree_attention(q, k, v, block, scale, None)
                dense = median_ms(lambda: sdpa(module, q, k, v, mask, scaling=scale), args.repeats)
                tree = median_ms(lambda: tree_attention(q, k, v, block, scale, None), args.repeats)
            diff = float((dense_out.float() - tree_out.float()).abs().max())
            print(f"| {prefix} | {n} | {dense:.3f} | {tree:.3f} | {dense / tree:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
