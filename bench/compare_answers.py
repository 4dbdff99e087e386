"""How many answers of one bench run differ from a reference run's, request by request.

bench/serve_adapt.py keeps every answer of every run as a digest in its results.json. In float32
greedy speculative decoding is token-identical to plain decoding, and its own `differ from off`
column shows it. In bf16 a tree forward rounds differently from a one-token forward, so where the
target's top two logits nearly tie an answer can change: this script counts how often, against a
`plain` run (`serve_adapt.py --runs plain`, possibly over fewer requests, possibly another
invocation), over the requests both answered.

    python bench/compare_answers.py runs/plain/results.json:plain runs/stream/results.json [more.json ...]

Prints one line per run of every further file: differing / compared. Bad input: exit 2, one line
naming the file and what is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def answers(runs: dict, run: str, path: str) -> dict[int, str]:
    """Request index -> answer digest of `run` among a results.json's `runs` (read from `path`;
    failed requests left out)."""
    if run not in runs:
        raise ValueError(f"{path}: no run {run!r} (it has {', '.join(sorted(runs)) or 'none'})")
    return {r["i"]: r["answer_sha256"] for r in runs[run].get("requests", []) if "answer_sha256" in r}


def load_runs(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: {err}") from None
    runs = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, dict):
        raise ValueError(f"{path}: no `runs` (not a bench/serve_adapt.py results.json)")
    return runs


def differing(reference: dict[int, str], other: dict[int, str]) -> tuple[int, int]:
    """(answers that differ, answers compared) over the requests both runs answered."""
    shared = sorted(set(reference) & set(other))
    return sum(reference[i] != other[i] for i in shared), len(shared)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reference", help="RESULTS.json:RUN, the answers the others are checked against")
    p.add_argument("others", nargs="+", help="results.json files whose every run is checked")
    args = p.parse_args(argv)
    path, sep, run = args.reference.rpartition(":")
    if not sep or not path or not run:
        print(f"reference {args.reference!r}: expected RESULTS.json:RUN", file=sys.stderr)
        return 2
    try:
        reference = answers(load_runs(path), run, path)
        rows = []
        for other in args.others:
            runs = load_runs(other)  # read once, every run of it checked
            rows += [(other, name, differing(reference, answers(runs, name, other))) for name in runs]
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    for other, name, (differ, compared) in rows:
        share = f"{differ / compared:.0%}" if compared else "-"
        print(f"{other} {name}: {differ} of {compared} answers differ from {args.reference} ({share})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
