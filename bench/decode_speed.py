"""Decoding speed on the real target, every decoder side by side in one process.

Not a test: it prints tokens/s, the ratios to plain decoding (ours and transformers' own
`generate`), acceptance length and the per-step time split, for each benchmark and temperature.
The decoders, run one after another on every prompt (interleaved, so machine noise hits all
alike; the first prompt of each is a warm-up and is not counted):

  hf-generate        transformers' greedy / sampling `generate` (the plain peer)
  plain              our plain decoding (root-only trees, same Target code path)
  hf-prompt-lookup   transformers' prompt lookup decoding (prompt_lookup_num_tokens=10)
  lookup             our prompt-lookup drafter (propose/lookup.py)
  HEAD 60/5/10       the best single head with the paper's tree
  HEAD 16/5/4        the same head with a small fixed tree
  HEAD auto          the same head with cost-aware trees (--tree auto)
  routed auto        confidence routing between the math and chat heads, auto trees
  merged-budget auto the budget merge of the math and chat heads, auto trees
  HEAD+lookup auto   the budget merge of the head and the lookup drafter

Greedy outputs are compared with our plain decoding: exact in float32; in bf16 a tree forward
and a one-token forward round differently, so a near-tie can flip a token, and the count of
answers that differ is printed, not hidden.

    python bench/decode_speed.py [--target smollm2-135m-instruct --drafters models/smollm2-135m-instruct/drafters
        --head eagle2-mixed-large --math eagle2-math --chat eagle2-chat --n 20 --new-tokens 128
        --temperatures 0,1 --dtype bfloat16 --threads 1 --data-dir ../shared/data]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from taps.config import DecodeConfig, SamplingConfig, TreeConfig  # noqa: E402
from taps.decode import chat_ids, generate  # noqa: E402
from taps.drafter.checkpoint import load_head  # noqa: E402
from taps.eval.benchmarks import load_benchmark  # noqa: E402
from taps.profile import auto_tree_policy  # noqa: E402
from taps.propose.factory import LookupSpec, build_proposer  # noqa: E402
from taps.target import Target  # noqa: E402

PAPER, SMALL, AUTO_CAPS = TreeConfig(60, 5, 10), TreeConfig(16, 5, 4), TreeConfig(96, 8, 8)
LOOKUP_TREE = TreeConfig(32, 10, 4)


@dataclass
class Tally:
    tokens: int = 0
    seconds: float = 0.0
    calls: int = 0
    draft_s: float = 0.0
    target_s: float = 0.0
    other_s: float = 0.0
    steps: int = 0
    differ: int = 0  # greedy answers that differ from our plain decoding's
    answers: int = 0
    sizes: list[int] = field(default_factory=list)

    def add_result(self, result) -> None:
        self.tokens += len(result.tokens)
        self.seconds += result.total_s
        self.calls += result.verifier_calls
        self.steps += len(result.steps)
        for s in result.steps:
            self.draft_s += s.draft_s
            self.target_s += s.target_s
            self.other_s += s.other_s
            self.sizes.append(s.tree_size)


def hf_generate(target: Target, ids: list[int], new_tokens: int, temperature: float, seed: int,
                lookup: bool) -> tuple[list[int], float]:
    """transformers' own generate on the same model: (new tokens, seconds)."""
    stops = list(target.stop_token_ids())
    x = torch.tensor([ids], device=target.device)
    options = dict(do_sample=False) if temperature == 0 else dict(do_sample=True, temperature=temperature, top_k=None,
                                                                  top_p=1.0)
    if lookup:
        options["prompt_lookup_num_tokens"] = 10
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = target.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                                    eos_token_id=stops, pad_token_id=stops[0], **options)
    seconds = time.perf_counter() - t0
    new = out[0, len(ids):].tolist()
    end = next((i for i, t in enumerate(new) if t in stops), None)
    return (new if end is None else new[:end + 1]), seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--drafters", default="models/smollm2-135m-instruct/drafters")
    ap.add_argument("--head", default="eagle2-mixed-large", help="the single head to time")
    ap.add_argument("--math", default="eagle2-math")
    ap.add_argument("--chat", default="eagle2-chat")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--n", type=int, default=20, help="questions per benchmark (+1 warm-up)")
    ap.add_argument("--benches", default="gsm8k,mt_bench")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", help="comma-separated decoder names to run (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    target = Target.load(args.target, device="cpu", dtype=args.dtype)
    drafters = Path(args.drafters)
    heads = {name: load_head(drafters / name, target)[0] for name in dict.fromkeys([args.head, args.math, args.chat])}
    policy = auto_tree_policy(target, heads, AUTO_CAPS)
    head, math_head, chat_head = heads[args.head], heads[args.math], heads[args.chat]
    pair = {"math": math_head, "chat": chat_head}
    decoders = {
        "hf-generate": "hf",
        "plain": lambda: None,
        "hf-prompt-lookup": "hf-lookup",
        "lookup": lambda: build_proposer("single", {"lookup": LookupSpec()}, LOOKUP_TREE),
        f"{args.head} 60/5/10": lambda: build_proposer("single", {"h": head}, PAPER),
        f"{args.head} 16/5/4": lambda: build_proposer("single", {"h": head}, SMALL),
        f"{args.head} auto": lambda: build_proposer("single", {"h": head}, AUTO_CAPS, policy=policy),
        "routed auto": lambda: build_proposer("route", pair, AUTO_CAPS, policy=policy),
        "merged-budget auto": lambda: build_proposer("merge", pair, AUTO_CAPS, merge_mode="budget", policy=policy),
        f"{args.head}+lookup auto": lambda: build_proposer("merge", {"h": head, "lookup": LookupSpec()}, AUTO_CAPS,
                                                           merge_mode="budget", policy=policy),
    }
    if args.only:
        keep = set(args.only.split(","))
        decoders = {k: v for k, v in decoders.items() if k in keep or k == "plain"}
    stops = target.stop_token_ids()
    temps = [float(t) for t in args.temperatures.split(",")]
    tallies: dict[tuple[str, float, str], Tally] = {}
    for bench in args.benches.split(","):
        questions = load_benchmark(bench, args.data_dir, limit=args.n + 1)
        for temp in temps:
            for qi, q in enumerate(questions):
                ids = chat_ids(target.tokenizer, [{"role": "user", "content": q.turns[0]}])
                reference = None
                for name, make in decoders.items():
                    tally = tallies.setdefault((bench, temp, name), Tally())
                    seed = 1000 * qi + 7
                    if isinstance(make, str):
                        tokens, seconds = hf_generate(target, ids, args.new_tokens, temp, seed, make == "hf-lookup")
                        if qi:
                            tally.tokens += len(tokens)
                            tally.seconds += seconds
                            tally.answers += 1
                        continue
                    cfg = DecodeConfig(max_new_tokens=args.new_tokens, stop_token_ids=stops, seed=seed,
                                       sampling=SamplingConfig(temp))
                    result = generate(target, make(), ids, cfg)
                    if name == "plain":
                        reference = result.tokens
                    if qi:  # the first question warms every decoder up
                        tally.add_result(result)
                        tally.answers += 1
                        tally.differ += int(temp == 0 and reference is not None and result.tokens != reference)
                print(f"{bench} T={temp:g} question {qi}/{len(questions) - 1} done", file=sys.stderr, flush=True)

    print(f"target {target.name} ({args.dtype}, {torch.get_num_threads()} thread(s)); head {args.head}; "
          f"{args.n} questions per benchmark (+1 warm-up), {args.new_tokens} new tokens; decoders interleaved per "
          f"question")
    for bench in args.benches.split(","):
        for temp in temps:
            plain = tallies[(bench, temp, "plain")]
            hf = tallies.get((bench, temp, "hf-generate"))
            base = plain.tokens / plain.seconds
            print(f"\n{bench}, T = {temp:g}\n")
            print("| decoder | tok/s | x plain | x hf-generate | tau | draft / target / other ms per step | "
                  "other % | mean tree | greedy answers != plain |")
            print("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
            for name in decoders:
                t = tallies[(bench, temp, name)]
                tps = t.tokens / t.seconds if t.seconds else float("nan")
                ratio_hf = tps / (hf.tokens / hf.seconds) if hf and hf.seconds else float("nan")
                if t.steps:
                    split = f"{1e3 * t.draft_s / t.steps:.1f} / {1e3 * t.target_s / t.steps:.1f} / " \
                            f"{1e3 * t.other_s / t.steps:.1f}"
                    other = 100 * t.other_s / (t.draft_s + t.target_s + t.other_s)
                    tau = f"{t.tokens / t.calls:.2f}"
                    size = f"{statistics.mean(t.sizes):.1f}"
                else:
                    split, other, tau, size = "-", float("nan"), "-", "-"
                differ = f"{t.differ}/{t.answers}" if temp == 0 and t.steps else "-"
                print(f"| {name} | {tps:.1f} | {tps / base:.2f} | {ratio_hf:.2f} | {tau} | {split} | {other:.0f} | "
                      f"{size} | {differ} |")


if __name__ == "__main__":
    main()
