"""What composing drafters costs per step, measured side by side in one run (not a test).

For single, route (confidence, per step), merge-disjoint, merge-trie and merge-budget it prints
the per-step wall time (draft + target forward + the rest), the verifier tokens per step (tree
nodes, root included), the acceptance length tau, tokens/s, and each as a ratio to single.
Runs are interleaved round-robin over repeats and prompts so machine noise hits every strategy
alike, and every output is checked token-identical to plain greedy decoding.

The target is random. The heads are "fine-tunes of one head": a closed-form head (taps.drafter.fit:
fc fitted by ridge regression on the target's greedy continuations) plus, per head, Gaussian noise
of --perturb times each parameter's std, so their trees overlap partly, as specialists of one
target do (--independent fits each head on its own prompts instead: little overlap). A random
target's continuations are close to unpredictable, so expect tau near 1: the numbers measure the
cost of the machinery, not the acceptance of trained heads.

    python bench/compose_cost.py [--heads 2 --perturb 0.1 --hidden 512 --layers 8 --new-tokens 48 --repeats 3]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from taps.core.config import DecodeConfig
from taps.core.decode import generate
from taps.drafter.average import average_heads
from taps.drafter.fit import fit_linear_head, greedy_sequences
from taps.propose.factory import build_proposer

from _random_target import add_tree_device_args, random_target  # beside this script

STRATEGIES = {
    "single": dict(strategy="single"),
    "route": dict(strategy="route", signal="confidence", granularity="step"),
    "merge-disjoint": dict(strategy="merge", merge_mode="disjoint"),
    "merge-trie": dict(strategy="merge", merge_mode="trie"),
    "merge-budget": dict(strategy="merge", merge_mode="budget"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--heads", type=int, default=2, help="number of specialist heads composed")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fit-sequences", type=int, default=32, help="greedy continuations each head is fitted on")
    ap.add_argument("--perturb", type=float, default=0.1, help="per-head noise, relative to each parameter's std")
    ap.add_argument("--independent", action="store_true", help="fit every head on its own prompts, no shared base")
    add_tree_device_args(ap)
    args = ap.parse_args()
    device, target, tree = random_target(args)
    model = target.model

    def random_prompts(n, length, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, args.vocab, (n, length), generator=g).tolist()

    def fitted(h):
        return fit_linear_head(target, greedy_sequences(target, random_prompts(args.fit_sequences, 8, 100 + h), 40),
                               seed=h)

    heads = {}
    base = None if args.independent else fitted(0)
    for h in range(args.heads):
        head = fitted(h) if args.independent else average_heads([base])  # a copy, bound like base
        if not args.independent and h > 0:
            g = torch.Generator().manual_seed(1000 + h)
            with torch.no_grad():
                for param in head.parameters():
                    noise = torch.randn(param.shape, generator=g).to(param.device, param.dtype)
                    param.add_(args.perturb * param.std() * noise)
        heads[f"spec-{h}"] = head
    prompts = random_prompts(args.prompts, args.prompt_len, 0)
    cfg = DecodeConfig(max_new_tokens=args.new_tokens)
    references = [generate(target, None, p, cfg).tokens for p in prompts]  # warm-up and the reference

    runs: dict[str, list] = {name: [] for name in STRATEGIES}
    for _ in range(args.repeats):
        for prompt, reference in zip(prompts, references):
            for name, spec in STRATEGIES.items():
                chosen = {"spec-0": heads["spec-0"]} if name == "single" else heads
                result = generate(target, build_proposer(tree=tree, heads=chosen, **spec), prompt, cfg)
                assert result.tokens == reference, f"{name} is not lossless"
                runs[name].append(result)

    n_params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"target: random {args.arch}, {n_params:.1f}M params, hidden {args.hidden}, {args.layers} layers, "
          f"vocab {args.vocab}, device {device}, threads {torch.get_num_threads()}")
    kind = "independently fitted" if args.independent else f"perturbed (x{args.perturb:g} std) copies of one fitted head"
    print(f"{args.heads} heads, {kind}; {args.prompts} prompts of {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens, tree {tree}, {args.repeats} interleaved repeats")
    print("every output was checked token-identical to plain greedy decoding\n")

    def summary(results):
        steps = [s for r in results for s in r.steps]
        step_s = [(r.total_s - r.prefill_s) / len(r.steps) for r in results]
        return {
            "ms/step": 1e3 * statistics.median(step_s),
            "draft ms": 1e3 * statistics.mean(s.draft_s for s in steps),
            "target ms": 1e3 * statistics.mean(s.target_s for s in steps),
            "verif tok": statistics.mean(s.tree_size for s in steps),
            "tau": sum(len(r.tokens) for r in results) / sum(r.verifier_calls for r in results),
            "tok/s": statistics.median(r.tokens_per_second for r in results),
        }

    rows = {name: summary(results) for name, results in runs.items()}
    base = rows["single"]
    print(f"{'strategy':<15} {'ms/step':>8} {'(x)':>5} {'draft ms':>9} {'target ms':>10} {'verif tok':>10} {'(x)':>5} "
          f"{'tau':>5} {'(x)':>5} {'tok/s':>7} {'(x)':>5}")
    for name, row in rows.items():
        print(f"{name:<15} {row['ms/step']:>8.2f} {row['ms/step'] / base['ms/step']:>5.2f} {row['draft ms']:>9.2f} "
              f"{row['target ms']:>10.2f} {row['verif tok']:>10.1f} {row['verif tok'] / base['verif tok']:>5.2f} "
              f"{row['tau']:>5.2f} {row['tau'] / base['tau']:>5.2f} {row['tok/s']:>7.1f} {row['tok/s'] / base['tok/s']:>5.2f}")


if __name__ == "__main__":
    main()
