"""Regeneration: replace every assistant turn of a data set with the target's own response.

A drafter trained on the target's own outputs matches the target better than one trained on the
data set's responses (the improvement users of EAGLE and SpecForge ask for). Each conversation is
replayed turn by turn through a ChatSession, so a later user turn follows the target's earlier
answers, exactly as at inference.

Resumable: one JSON line per finished record, written in a single write and fsync'ed; a rerun
skips every id already in the output, and drops a torn last line left by a crash.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from taps.config import DecodeConfig, SamplingConfig
from taps.data.features import read_records
from taps.decode import ChatSession
from taps.jsonl import JsonlFormatError, append_jsonl, read_jsonl


@dataclass
class RegenerateSettings:
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


def _done_ids(out: Path) -> set[str]:
    """Ids already written; a torn last line (crash during a write) is cut off."""
    try:
        rows, _ = read_jsonl(out, repair_torn=True)
    except JsonlFormatError as err:
        raise ValueError(f"{err}; refusing to append to it") from None
    for lineno, row in rows:
        if "id" not in row:
            raise ValueError(f"{out}: line {lineno} is not a regenerated record; refusing to append to it")
    return {str(row["id"]) for _, row in rows}


def regenerate(target, data: str | Path, out: str | Path, settings: RegenerateSettings = RegenerateSettings(),
               proposer=None, progress=sys.stderr) -> int:
    """Regenerate every record of `data` not yet in `out`; returns how many were written now."""
    data, out = Path(data), Path(out)
    records = read_records(data)
    ids = [str(r.get("id", i)) for i, r in enumerate(records)]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"{data}: record id {dup!r} appears more than once; ids must be unique to resume")
    out.parent.mkdir(parents=True, exist_ok=True)
    done = _done_ids(out)
    base = DecodeConfig(max_new_tokens=settings.max_new_tokens,
                        sampling=SamplingConfig(settings.temperature, settings.top_p),
                        stop_token_ids=target.stop_token_ids())
    written, start = 0, time.time()
    todo = [(i, r) for i, r in enumerate(records) if ids[i] not in done]
    for n, (i, record) in enumerate(todo, 1):
        new_record = _regenerate_one(target, record, replace(base, seed=settings.seed * 1_000_003 + i), proposer)
        new_record["regenerated"].update(temperature=settings.temperature, seed=settings.seed)
        append_jsonl(out, [new_record])
        written += 1
        if progress is not None and (n % 10 == 0 or n == len(todo)):
            rate = n / (time.time() - start)
            print(f"regenerate: {len(done) + n}/{len(records)} records, {rate:.2f} records/s, "
                  f"ETA {(len(todo) - n) / rate / 60:.1f} min", file=progress, flush=True)
    return written


def _regenerate_one(target, record: dict, cfg: DecodeConfig, proposer) -> dict:
    turns = record["conversations"]
    system = turns[0]["content"] if turns and turns[0]["role"] == "system" else None
    session = ChatSession(target, proposer, cfg, system=system)
    stops, new_tokens = [], 0
    for turn in turns:
        if turn["role"] == "user":
            _, result = session.send(turn["content"])
            stops.append(result.stop_reason)
            new_tokens += len(result.tokens)
    return {**record, "conversations": session.messages,
            "regenerated": {"original_turns": len(turns), "stop_reasons": stops, "new_tokens": new_tokens}}
