"""What an adapted head adds where a `--learn` server uses it: held-out acceptance length of head
versions alone and merged with the lookup member over a datastore of the adaptation's training
answers (`merge-budget:HEAD,lookup+STORE`, `--tree auto`), on one `taps adapt` run's split.

Why: `taps adapt` judges a version by the head's own acceptance, but a server with --learn serves
it merged with prompt lookup and the online datastore, which already draft much of what the head
learns (docs/learn.md). The store here holds the training answers only (DIR/store would hold the
held-out answers too, and lookup would copy them).

Not a test; acceptance only (no timing), greedy, one thread. Each held-out prompt decodes as
many tokens as its logged answer had (at most --max-new-tokens), as `taps adapt` does.

    python bench/adapt_in_merge.py --work runs/learn/adapt/eagle2-mixed-xl/v1 \\
        --head v0=models/smollm2-135m-instruct/drafters/eagle2-mixed-xl \\
        --head v1=runs/learn/adapt/eagle2-mixed-xl/v1/train
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from taps.core.config import DecodeConfig, SpeculationConfig
from taps.core.decode import chat_ids, generate
from taps.core.jsonl import read_json_lines
from taps.core.target import TargetRef, tokenizer_fingerprint
from taps.data.chat import special_ids
from taps.drafter.profile import tree_policy
from taps.propose.factory import HeadPool
from taps.propose.rest import write_datastore
from taps.propose.spec import variant_from_config
from taps.serve.online_store import answer_segment


def acceptance(target, ref: TargetRef, variant: str, records: list[dict], max_new_tokens: int) -> tuple[int, int]:
    """(generated tokens, verifier calls) of `variant` over the records' prompts, --tree auto."""
    spec = variant_from_config("judged", variant, "bench/adapt_in_merge.py")
    speculation = SpeculationConfig.of(mode="auto")
    pool = HeadPool(target, ref.attn)
    policy = tree_policy(target, pool.heads(spec).values(), speculation)
    tokens = calls = 0
    for record in records:
        ids = chat_ids(target.tokenizer, record["conversations"][:-1])
        n = max(1, min(max_new_tokens, len(record["served"]["answer_tokens"])))
        cfg = DecodeConfig(max_new_tokens=n, stop_token_ids=target.stop_token_ids())
        result = generate(target, pool.proposer(spec, speculation.tree, policy), ids, cfg)
        tokens, calls = tokens + len(result.tokens), calls + result.verifier_calls
    return tokens, calls


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
    train = [row for _, row in read_json_lines(work / "train.jsonl")]
    heldout = [row for _, row in read_json_lines(work / "heldout.jsonl")]
    special = special_ids(target.tokenizer)
    segments = [answer_segment(chat_ids(target.tokenizer, r["conversations"][:-1]), r["served"]["answer_tokens"],
                               special) for r in train]
    with tempfile.TemporaryDirectory(prefix="adapt-in-merge-") as tmp:
        store = Path(tmp) / "store"
        write_datastore(store, segments, {"target": args.target,
                                          "tokenizer_fingerprint": tokenizer_fingerprint(target.tokenizer)})
        print(f"{len(heldout)} held-out requests of {work}; store: {len(train)} training answers; {args.dtype}\n")
        print("| head | alone | merged with lookup + store |")
        print("| --- | ---: | ---: |")
        for label, path in heads.items():
            alone = acceptance(target, ref, path, heldout, args.max_new_tokens)
            merged = acceptance(target, ref, f"merge-budget:{path},lookup+{store}", heldout, args.max_new_tokens)
            print(f"| {label} | {alone[0] / alone[1]:.2f} | {merged[0] / merged[1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
