"""How much a retrieval datastore (REST) would add to prompt lookup, measured without a model forward.

Not a test. For the target's own greedy answers to benchmark questions (our plain decoding's
records in a decode-speed run: `--speed-records DIR` holding decode-speed-BENCH.jsonl), it replays
decoding step by step: at each step the lookup drafter (propose/lookup.py) drafts its tree from the
prompt and the answer so far, the tree's longest path that matches the answer's next tokens is
accepted (exactly what greedy verification would accept, the answer being the target's greedy
output) plus the bonus token, and the replay moves on. Printed per benchmark and drafter setting:
tau (tokens per step, the mean accepted length + 1), the mean tree size, the draft time per step
and an estimated speedup over plain decoding from the target's measured forward costs (the
SmolLM2-135M bf16 one-thread costs of issue 19: 57.6 / 70.8 / 83.8 / 102.8 ms for 1 / 16 / 32 /
64 tree tokens, interpolated; draft time included).

Settings: prompt lookup alone (n = 3..1, as shipped), the datastore alone, and both (prompt lookup
first, the datastore filling the rest of the tree), the datastore with several n-gram ranges.
The datastore is built from --records (the target's regenerated training answers) into --store
once; the benchmark's prompts are checked against the records' user turns (none may appear there).

    python bench/datastore_hit_rate.py --speed-records ../main/runs/bench \\
        --records ../main/runs/study-smollm2/work/drafters/chat.regenerated.jsonl,...math.regenerated.jsonl \\
        [--store /tmp/taps-datastore --target smollm2-135m-instruct --data-dir ../shared/data]
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import numpy as np
import torch

from taps.core.config import TreeConfig
from taps.data.datastore import build_datastore
from taps.core.decode import chat_ids
from taps.eval.benchmarks import load_benchmark
from taps.core.jsonl import read_json_lines, read_jsonl
from taps.propose.rest import MANIFEST, Datastore
from taps.propose.lookup import LookupProposer, LookupSpec
from taps.core.verify import Acceptance

COSTS_MS = {1: 57.6, 16: 70.8, 32: 83.8, 64: 102.8}  # issue 19: SmolLM2-135M, bf16, one thread


def forward_ms(size: int) -> float:
    xs = sorted(COSTS_MS)
    return float(np.interp(size, xs, [COSTS_MS[x] for x in xs], right=None))


def normal(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def contamination(records: list[Path], benches: list[str], data_dir) -> list[str]:
    """Benchmark prompts (every turn) found among the records' user turns: exactly (normalised) or
    as their first 80 characters inside a user turn."""
    users = []
    for path in records:
        for _, record in read_json_lines(path):
            users += [normal(t["content"]) for t in record["conversations"] if t["role"] == "user"]
    exact, lines = set(users), []
    blob = "\n".join(users)
    for bench in benches:
        turns = [normal(t) for q in load_benchmark(bench, data_dir) for t in q.turns]
        same = sum(t in exact for t in turns)
        inside = sum(t[:80] in blob for t in turns)
        lines.append(f"{bench}: {len(turns)} prompts (every turn) against {len(users):,} user turns of the records: "
                     f"{same} identical, {inside} whose first 80 characters occur in one")
    return lines


def answers(speed_dir: Path, bench: str) -> dict[int, list[int]]:
    """Our plain greedy decoding's answers of a decode-speed run, by question index."""
    rows, _ = read_jsonl(speed_dir / f"decode-speed-{bench}.jsonl")
    return {r["question"]: r["tokens"] for _, r in rows if r["decoder"] == "plain" and r["temperature"] == 0}


def replay(make, prompt: list[int], answer: list[int]) -> tuple[int, int, int, float, float]:
    """(steps, tokens, tree nodes, draft seconds, target forward ms) of decoding `answer` with the
    proposer make()."""
    proposer = make()
    proposer.start(torch.zeros(1), torch.tensor(prompt + answer[:1]))
    pos, steps, tokens, nodes, draft_s, forward = 1, 0, 0, 0, 0.0, 0.0
    while pos < len(answer):
        t0 = time.perf_counter()
        tree = proposer.propose()
        draft_s += time.perf_counter() - t0
        children: dict[tuple[int, int], int] = {}
        for i, (parent, token) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist())):
            if parent >= 0:
                children[(parent, token)] = i
        path = [0]
        while pos + len(path) - 1 < len(answer) and (path[-1], answer[pos + len(path) - 1]) in children:
            path.append(children[(path[-1], answer[pos + len(path) - 1])])
        accepted = len(path) - 1
        emitted = answer[pos:pos + accepted + 1]
        steps, tokens, nodes = steps + 1, tokens + len(emitted), nodes + tree.size
        forward += forward_ms(tree.size)
        if pos + accepted >= len(answer):
            break
        acceptance = Acceptance(nodes=torch.tensor(path), tokens=tree.tokens[torch.tensor(path)], bonus=emitted[-1])
        proposer.observe(tree, acceptance, torch.zeros(1))
        pos += len(emitted)
    return steps, tokens, nodes, draft_s, forward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--speed-records", required=True, help="directory holding decode-speed-BENCH.jsonl")
    ap.add_argument("--records", required=True, help="comma-separated chat JSONL files: the datastore's corpus")
    ap.add_argument("--store", default="/tmp/taps-datastore-hit-rate", help="datastore directory (built once)")
    ap.add_argument("--index-depth", type=int, default=12)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--benches", default="mt_bench,gsm8k")
    ap.add_argument("--tree", default="32,10,4", help="total_tokens,depth,top_k of every tree")
    ap.add_argument("--small-tree", default="16,6,4", help="a second, smaller tree for the combined drafter")
    ap.add_argument("--max-matches", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(1)
    records = [Path(r) for r in args.records.split(",")]
    benches = args.benches.split(",")

    for line in contamination(records, benches, args.data_dir):
        print(line)
    store_dir = Path(args.store)
    if not (store_dir / MANIFEST).is_file():
        print(build_datastore(records, args.target, store_dir, depth=args.index_depth))
    t0 = time.perf_counter()
    store = Datastore.load(store_dir)
    print(f"datastore {store_dir}: {store.size:,} tokens, {store.manifest['segments']:,} segments, index depth "
          f"{store.depth}; loaded in {time.perf_counter() - t0:.2f} s")
    from transformers import AutoTokenizer

    from taps.core.targets import resolve_target
    tokenizer = AutoTokenizer.from_pretrained(resolve_target(args.target))

    tree, small = (TreeConfig(*map(int, t.split(","))) for t in (args.tree, args.small_tree))
    settings: dict[str, object] = {"lookup 3..1": lambda: LookupProposer(tree)}

    def lookup(shape: TreeConfig, **spec) -> LookupProposer:
        return LookupProposer(shape, LookupSpec(**{"store_nodes": None, **spec}), max_matches=args.max_matches)

    for hi, lo in ((2, 1), (3, 1), (4, 1), (5, 1), (8, 1), (8, 2), (8, 3), (12, 2)):
        if hi > store.depth:
            continue
        ds = dict(datastore=store, store_max_ngram=hi, store_min_ngram=lo)
        settings[f"store {hi}..{lo}"] = lambda ds=ds: lookup(tree, prompt=False, **ds)
        settings[f"lookup+store {hi}..{lo}"] = lambda ds=ds: lookup(tree, **ds)
    for hi in (3, 8):
        ds = dict(datastore=store, store_max_ngram=hi, store_min_ngram=1)
        for nodes in (4, 8, 16):
            settings[f"lookup+store {hi}..1, <= {nodes} store nodes"] = \
                lambda nodes=nodes, ds=ds: lookup(tree, store_nodes=nodes, **ds)
        settings[f"lookup+store {hi}..1, tree {args.small_tree}"] = lambda ds=ds: lookup(small, **ds)
        settings[f"lookup+store {hi}..1, tree {args.small_tree}, <= 8 store nodes"] = \
            lambda ds=ds: lookup(small, store_nodes=8, **ds)
    settings[f"lookup 3..1, tree {args.small_tree}"] = lambda: LookupProposer(small)

    print(f"\ntrees {args.tree} (total,depth,top_k) unless named; tau = tokens per step (accepted + bonus); "
          "speed est. = plain's forward time / (forward time of the tree + draft time), per token")
    for bench in benches:
        plain = answers(Path(args.speed_records), bench)
        questions = load_benchmark(bench, args.data_dir, limit=max(plain) + 1)
        prompts = {qi: chat_ids(tokenizer, [{"role": "user", "content": questions[qi].turns[0]}]) for qi in plain}
        total = sum(len(a) - 1 for a in plain.values())
        print(f"\n{bench}: {len(plain)} answers of our plain greedy decoding (T = 0), {total:,} tokens after the first")
        print(f"  {'drafter':<56} {'tau':>6} {'steps':>6} {'nodes/step':>10} {'draft ms':>9} {'speed est.':>10}")
        for name, make in settings.items():
            steps = tokens = nodes = 0
            draft_s = cost_ms = 0.0
            for qi, answer in plain.items():
                s, t, n, d, f = replay(make, prompts[qi], answer)
                steps, tokens, nodes, draft_s, cost_ms = steps + s, tokens + t, nodes + n, draft_s + d, cost_ms + f
            cost_ms += 1000 * draft_s
            speed = COSTS_MS[1] * tokens / cost_ms
            print(f"  {name:<56} {tokens / steps:6.3f} {steps:6d} {nodes / steps:10.1f} "
                  f"{1000 * draft_s / steps:9.2f} {speed:9.2f}x")


if __name__ == "__main__":
    main()
