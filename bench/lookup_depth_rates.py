"""How often prompt lookup's draft tokens are accepted, by depth and by match length, on the answers
a long-prompt run decoded plainly.

Not a test: it replays the `plain` answers of a `bench/decode_speed.py --workload long` records file
(greedy, so the target's own tokens) through the lookup drafter (propose/lookup.py), greedy-verifying
its best continuation (rank 0) at every step as the decoder would, and prints for each depth the
rate at which a draft token is accepted once its parent was, and for each match length n the same
by depth band. These are the rates `LookupProposer` learns per (n, depth band) cell: a copy, once
begun, goes on, so one pooled rate misprices a chain (docs/long-context.md, session 36).

    python bench/lookup_depth_rates.py runs/bench/long-s36.jsonl

Bad input: exit 2, one line naming the file and what is wrong.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

import torch

from taps.core.config import TreeConfig
from taps.core.decode import chat_ids
from taps.core.jsonl import read_jsonl
from taps.core.target import Target
from taps.propose.lookup import LookupProposer, depth_band

from _long_prompts import WORKLOADS, load_long  # bench/: the script's own folder is on sys.path

DEPTH = 48  # as deep as `--tree auto` lets a lookup chain run (propose/factory.AUTO_LOOKUP_DEPTH)
SHOWN = 20  # depths past this are pooled in one row


def replay(prompt: list[int], answer: list[int], tried: Counter, accepted: Counter) -> None:
    """Greedy-verify lookup's rank-0 chain at every step of `answer`, counting per (n, depth)."""
    proposer = LookupProposer(TreeConfig(DEPTH + 1, DEPTH, 1))
    proposer.start(torch.zeros(len(prompt), 1), torch.tensor(prompt + answer[:1]))
    pos = 0  # answer[:pos + 1] is committed
    while pos < len(answer) - 1:
        found = proposer.matches()
        took = 0
        if found:
            n, chain = found[0]
            for depth, token in enumerate(chain[:len(answer) - pos - 1], 1):
                tried[(n, depth)] += 1
                if token != answer[pos + depth]:
                    break
                accepted[(n, depth)] += 1
                took = depth
        proposer.advance(answer[pos + 1:pos + took + 2])  # the accepted tokens and the bonus
        pos += took + 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("records", help="a bench/decode_speed.py --workload long records file (JSONL)")
    p.add_argument("--target", default="smollm2-135m-instruct", help="the target whose tokenizer made the prompts")
    args = p.parse_args(argv)
    try:
        records = [record for _, record in read_jsonl(args.records)[0]]
    except (OSError, ValueError) as err:
        print(f"{args.records}: {err}", file=sys.stderr)
        return 2
    plain = {(r["bench"], r["question"]): r["tokens"] for r in records
             if r.get("decoder") == "plain" and r.get("temperature") == 0.0}
    if not plain or any(bench not in WORKLOADS for bench, _ in plain):
        print(f"{args.records}: no greedy `plain` answers of a --workload long run", file=sys.stderr)
        return 2
    tokenizer = Target.load(args.target, device="cpu", dtype="float32").tokenizer

    def count(text: str) -> int:
        return len(chat_ids(tokenizer, [{"role": "user", "content": text}]))

    tried, accepted = Counter(), Counter()
    for bench in sorted({b for b, _ in plain}):
        questions = load_long(bench, count, max(q for b, q in plain if b == bench) + 1)
        for index, question in enumerate(questions):
            if (bench, index) in plain:
                prompt = chat_ids(tokenizer, [{"role": "user", "content": question.turns[0]}])
                replay(prompt, plain[(bench, index)], tried, accepted)

    def rate(keys) -> str:
        t = sum(tried[k] for k in keys)
        return f"{sum(accepted[k] for k in keys) / t:.2f} ({t})" if t else "-"

    print(f"{len(plain)} plain answers of {args.records}; rank-0 chains up to {DEPTH} deep")
    print("| depth | accepted once its parent was (tries) |\n| ---: | ---: |")
    for depth in range(1, SHOWN + 1):
        last = depth == SHOWN
        keys = [k for k in tried if (k[1] >= depth if last else k[1] == depth)]
        print(f"| {depth}{'+' if last else ''} | {rate(keys)} |")
    ns = sorted({n for n, _ in tried})
    bands = sorted({depth_band(d) for _, d in tried})
    print("\n| n, depth band | " + " | ".join(str(b) for b in bands) + " |")
    print("| ---: | " + " | ".join("---:" for _ in bands) + " |")
    for n in ns:
        cells = [rate([k for k in tried if k[0] == n and depth_band(k[1]) == b]) for b in bands]
        print(f"| {n} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
