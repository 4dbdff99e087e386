"""How deep a lookup member may draft in a priced budget merge (`--tree auto`): acceptance length
for several (AUTO_LOOKUP_DEPTH, AUTO_STORE_NODES) settings of taps.propose.factory, the head's caps
unchanged, on one question set. Acceptance only, so it may run beside other jobs (slowly).

Not a test. The variant is `merge-budget:HEAD,lookup[+STORE]`, greedy, bf16, one thread.

    python bench/lookup_caps.py --head models/smollm2-135m-instruct/drafters/eagle2-mixed-xl \\
        --questions extract-json --store runs/serve_adapt_json/learn-store/store --n 12 --caps 8/8,24/24
    python bench/lookup_caps.py --head ... --questions gsm8k --store runs/datastore-family --n 10 --new-tokens 128

--questions: gsm8k, mt_bench (first turns) or extract-json (bench/serve_adapt.py's task over GSM8K
train questions 201 onward, past the 200 of its stream).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from taps.core.config import DecodeConfig, SpeculationConfig
from taps.core.jsonl import read_json_lines
from taps.core.target import TargetRef
from taps.eval.benchmarks import load_benchmark
from taps.propose import factory
from taps.propose.generate import generate_prompt
from taps.propose.spec import variant_from_config

from serve_adapt import TASKS  # bench/serve_adapt.py, beside this script: its extract-json prompt


def questions(which: str, data_dir: str, n: int) -> list[str]:
    if which == "extract-json":
        rows = [row for _, row in read_json_lines(Path(data_dir) / "gsm8k" / "train.jsonl")]
        return [TASKS["extract-json"].format(q=row["question"]) for row in rows[200:200 + n]]
    return [q.turns[0] for q in load_benchmark(which, data_dir, limit=n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", required=True)
    ap.add_argument("--store", default=None, help="a datastore directory (default: prompt lookup alone)")
    ap.add_argument("--questions", default="extract-json", choices=["extract-json", "gsm8k", "mt_bench"])
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--caps", default="8/8,24/24", help="DEPTH/STORE_NODES settings, comma-separated")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    args = ap.parse_args()
    torch.set_num_threads(1)
    texts = questions(args.questions, args.data_dir, args.n)
    member = "lookup" + (f"+{args.store}" if args.store else "")
    spec = variant_from_config("probe", f"merge-budget:{args.head},{member}", "bench/lookup_caps.py")
    target = TargetRef(args.target, "cpu", "bfloat16")
    print("| lookup depth / datastore nodes | acceptance length | mean tree tokens | steps accepting more than 8 |")
    print("| --- | ---: | ---: | ---: |")
    for caps in args.caps.split(","):
        factory.AUTO_LOOKUP_DEPTH, factory.AUTO_STORE_NODES = (int(x) for x in caps.split("/"))
        tokens = calls = steps = size = deep = 0
        for text in texts:
            result = generate_prompt(target, spec, text, speculation=SpeculationConfig.of(mode="auto"),
                                     decode=DecodeConfig(max_new_tokens=args.new_tokens)).result
            tokens, calls = tokens + len(result.tokens), calls + result.verifier_calls
            steps, size = steps + len(result.steps), size + sum(s.tree_size for s in result.steps)
            deep += sum(s.accepted > 8 for s in result.steps)
        print(f"| {caps} | {tokens / calls:.2f} | {size / steps:.1f} | {deep / steps:.1%} |", flush=True)


if __name__ == "__main__":
    main()
