"""What an adapted head adds where a `--learn` server uses it: held-out acceptance length of head
versions alone and merged with the lookup member over a datastore of the adaptation's training
answers (`merge-budget:HEAD,lookup+STORE`, `--tree auto`), on one `taps adapt` run's split.

Why: `taps adapt` judges a version by the head's own acceptance, but a server with --learn serves
it merged with prompt lookup and the online datastore, which already draft much of what the head
learns (docs/learn.md). The store is `taps adapt --judge merge`'s judge-store/: the training answers only (DIR/store would hold the
held-out answers too, and lookup would copy them).

Not a test; acceptance only (no timing), greedy, one thread. Each held-out prompt decodes as
many tokens as its logged answer had (at most --max-new-tokens), as `taps adapt` does.

    python bench/adapt_in_merge.py --work runs/learn/adapt/eagle2-mixed-xl/v1 \\
        --head v0=models/smollm2-135m-instruct/drafters/eagle2-mixed-xl \\
        --head v1=runs/learn/adapt/eagle2-mixed-xl/v1/train
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from taps.core.config import SpeculationConfig
from taps.core.jsonl import read_json_lines
from taps.core.target import TargetRef
from taps.drafter.profile import tree_policy
from taps.propose.factory import HeadPool
from taps.propose.spec import variant_from_config
from taps.serve.adapt import acceptance, judge_store


def judged(target, ref: TargetRef, variant: str, records: list[dict], max_new_tokens: int) -> float:
    """serve/adapt.acceptance of `variant` over the records' prompts, --tree auto."""
    spec = variant_from_config("judged", variant, "bench/adapt_in_merge.py")
    speculation = SpeculationConfig.of(mode="auto")
    pool = HeadPool(target, ref.attn)
    policy = tree_policy(target, pool.heads(spec).values(), speculation)
    return acceptance(target, None, records, max_new_tokens,
                      proposer=lambda: pool.proposer(spec, speculation.tree, policy))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, help="a taps adapt run's directory (DIR/adapt/NAME/vK)")
    ap.add_argument("--head", action="append", required=True, metavar="LABEL=DIR", help="a head version (repeat)")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(1)
    heads = dict(h.split("=", 1) for h in args.head)
    work = Path(args.work)
    ref = TargetRef(args.target, "cpu", args.dtype)
    target = ref.load()
    heldout = [row for _, row in read_json_lines(work / "heldout.jsonl")]
    store = judge_store(target, work)  # the training answers only, as `taps adapt --judge merge` builds it
    print(f"{len(heldout)} held-out requests of {work}; store: {store}; {args.dtype}\n")
    print("| head | alone | merged with lookup + store |")
    print("| --- | ---: | ---: |")
    for label, path in heads.items():
        alone = judged(target, ref, path, heldout, args.max_new_tokens)
        merged = judged(target, ref, f"merge-budget:{path},lookup+{store}", heldout, args.max_new_tokens)
        print(f"| {label} | {alone:.2f} | {merged:.2f} |", flush=True)


if __name__ == "__main__":
    main()
