"""Plain vs speculative decoding speed on a random target, measured side by side in one run.

Not a test: it prints tokens/s, their ratio to plain decoding, and the per-step time split
(draft / target forward / the rest). Three decoders share one Target and one cache code path:
  plain        root-only trees (autoregressive decoding)
  random-head  an untrained EAGLE head: acceptance ~1, so this shows the pure overhead
  oracle-tree  an EAGLE-2-shaped tree that contains the target's own continuation: the
               machinery's ceiling when drafts are right (cost of a real head not included)
Runs are interleaved round-robin so machine noise hits every decoder alike.

    python bench/decode_overhead.py [--hidden 512 --layers 8 --new-tokens 64 --repeats 3 --device cpu]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from taps.core.config import DecodeConfig, TreeConfig
from taps.core.decode import generate
from taps.drafter.checkpoint import init_head
from taps.core.proposer import StepInfo
from taps.propose.single import SingleProposer
from taps.core.tree import DraftTree

from _random_target import add_tree_device_args, random_target  # beside this script


class OracleTree:
    """Root -> the true next `depth` tokens as one branch, plus decoy siblings at every level,
    up to `total` nodes: the verifier pays for a full tree, and the true path is always accepted."""

    def __init__(self, reference: list[int], tree: TreeConfig, vocab: int):
        self.reference, self.tree, self.vocab, self.seq = reference, tree, vocab, []

    def start(self, features, tokens):
        self.seq = tokens.tolist()

    def observe(self, tree, acceptance, features):
        self.seq += acceptance.new_tokens

    def step_info(self) -> StepInfo:
        return StepInfo()

    def propose(self) -> DraftTree:
        true = self.reference[len(self.seq):len(self.seq) + self.tree.depth]
        parents, tokens, chain = [-1], [self.seq[-1]], [0]
        for tok in true:
            parents.append(chain[-1])
            tokens.append(tok)
            chain.append(len(tokens) - 1)
        i = 0
        while len(tokens) < self.tree.total_tokens and true:
            parent = chain[i % len(true)]
            parents.append(parent)
            tokens.append((tokens[chain[(i % len(true)) + 1]] + 1 + i) % self.vocab)
            i += 1
        n = len(tokens)
        device = torch.device("cpu")
        return DraftTree.drafted(tokens=torch.tensor(tokens, device=device), parents=torch.tensor(parents, device=device),
                                 logp=-torch.arange(n, dtype=torch.float), entropy=torch.zeros(n), drafter=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    add_tree_device_args(ap)
    args = ap.parse_args()
    device, target, tree = random_target(args)
    model = target.model
    head = init_head(model.config, seed=1).to(device).bind(target.embed_tokens, target.lm_head)
    prompt = torch.randint(0, args.vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    cfg = DecodeConfig(max_new_tokens=args.new_tokens)
    reference = prompt + generate(target, None, prompt, cfg).tokens  # warm-up and the oracle's answer

    decoders = {
        "plain": lambda: None,
        "random-head": lambda: SingleProposer(head, tree),
        "oracle-tree": lambda: OracleTree(reference, tree, args.vocab),
    }
    runs: dict[str, list] = {name: [] for name in decoders}
    for _ in range(args.repeats):
        for name, make in decoders.items():
            result = generate(target, make(), prompt, cfg)
            assert result.tokens == reference[len(prompt):], f"{name} is not lossless"
            runs[name].append(result)

    n_params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"target: random {args.arch}, {n_params:.1f}M params, hidden {args.hidden}, {args.layers} layers, "
          f"vocab {args.vocab}, device {device}, threads {torch.get_num_threads()}")
    print(f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, tree {tree}, {args.repeats} interleaved repeats")
    print("every decoder's output was checked token-identical to plain greedy decoding\n")
    base = statistics.median(r.tokens_per_second for r in runs["plain"])
    print(f"{'decoder':<12} {'tok/s':>8} {'ratio':>6} {'tau':>5} {'steps':>5} "
          f"{'draft ms/step':>13} {'target ms/step':>14} {'other ms/step':>13}")
    for name, results in runs.items():
        tps = statistics.median(r.tokens_per_second for r in results)
        steps = [s for r in results for s in r.steps]
        ms = lambda attr: 1e3 * statistics.mean(getattr(s, attr) for s in steps)  # noqa: E731
        print(f"{name:<12} {tps:>8.1f} {tps / base:>6.2f} {results[0].acceptance_length:>5.2f} "
              f"{len(results[0].steps):>5} {ms('draft_s'):>13.2f} {ms('target_s'):>14.2f} {ms('other_s'):>13.2f}")


if __name__ == "__main__":
    main()
