"""bench/_long_prompts.py: which first turns make the long-prompt workloads (summarisation,
retrieval-QA), the token window, file order and the limit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _long_prompts import kind_of, select  # noqa: E402

FILLER = "The committee met on Tuesday and agreed to review the budget again next month. " * 40  # ~3,200 chars


def record(rid: str, text: str, role: str = "user") -> dict:
    return {"id": rid, "conversations": [{"role": role, "content": text}, {"role": "assistant", "content": "ok"}]}


def test_kinds():
    assert kind_of('Web search results:\n\n[1] "A passage." URL: https://x\n\nQuery: who?') == "retrieval-qa"
    assert kind_of("Summarize this article:\n" + FILLER) == "summarisation"
    assert kind_of(FILLER + "\nTL;DR please") == "summarisation"
    assert kind_of("Write a poem about " + FILLER) is None
    assert kind_of(FILLER[:400] + " the summary statistics " + FILLER) is None  # the request is not at either end


def test_selection_keeps_file_order_the_window_and_the_limit():
    records = [
        record("a", "Summarize this:\n" + FILLER),
        record("b", "Summarize this:\n" + FILLER, role="assistant"),  # not a user's first turn
        record("c", 'Web search results:\n[1] "' + FILLER + '"\nQuery: what was agreed?'),
        record("d", "Summarize this:\n" + FILLER[:500]),  # too short
        record("e", "Summarise the following.\n" + FILLER * 2),
        record("f", "Summarize this:\n" + FILLER),
    ]
    words = lambda text: len(text.split())  # noqa: E731 - a stand-in tokenizer
    got = select(records, "summarisation", words, limit=5, low=400, high=1200)
    assert [q.question_id for q in got] == ["a", "e", "f"] and got[0].turns == (records[0]["conversations"][0]["content"],)
    assert [q.question_id for q in select(records, "summarisation", words, limit=1, low=400, high=1200)] == ["a"]
    assert [q.question_id for q in select(records, "summarisation", words, limit=5, low=400, high=800)] == ["a", "f"]
    assert [q.question_id for q in select(records, "retrieval-qa", words, limit=5, low=400, high=1200)] == ["c"]
    with pytest.raises(ValueError, match="unknown long workload 'news'"):
        select(records, "news", words, limit=1)
