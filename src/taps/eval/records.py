"""The results record: one JSON line per (variant, benchmark, temperature, question, turn).

Everything the metrics and the report compute comes from these records, so they keep the raw
per-step facts rather than summaries (docs/spec.md §5). Field by field:

identity    variant, bench, question_id (str), turn (0-based), temperature, category, seed,
            drafters (member names of a composed variant, in drafter-index order; [] for baseline)
outcome     new_tokens (incl. the token the prefill emits), verifier_calls (steps + the prefill),
            prompt_tokens, reused_prefix, stop_reason, output (decoded text)
per step    lists with one entry per verifier step (the prefill is not a step):
            accepted (draft tokens accepted, bonus excluded, before stop/budget cuts), emitted,
            tree_size (nodes verified incl. root), source (the drafter credited with the deepest accepted node:
            the lowest-numbered that proposed it, -1 if none), sources (bitmask of every drafter that proposed it: merged trees), step_info (the proposer's record: route_chosen / route_scores,
            merge sizes), tree_confidence_mean / tree_entropy_mean (over the tree's non-root
            nodes, i.e. tree_size - 1 of them: the routing scores a head would get; None for a
            root-only tree), accepted_confidence /
            accepted_entropy (lists, accepted nodes in path order), rejected_count,
            rejected_confidence_mean / rejected_entropy_mean (None when nothing was rejected),
            verifier_entropy_accepted (list), verifier_entropy_rejected (None at a leaf)
histograms  draft_entropy_hist: {"accepted": [...], "rejected": [...]} counts of node draft
            entropies in ENTROPY_BIN_EDGES bins (the last bin is open-ended)
timing      wall_s (decode time, prefill included, tracing excluded), prefill_s, draft_s,
            target_s, other_s, trace_s (the tracing itself)
What the variant was (strategy, signal, members' directories), the tree and the decoding
settings are in the results directory's run.json, written by the runner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from taps.core.decode import DecodeResult
from taps.core.jsonl import JsonlFormatError, read_jsonl

RECORD_VERSION = 1
ENTROPY_BIN_WIDTH = 0.25  # nats
ENTROPY_BINS = 48  # [0, 12) nats in 0.25 steps; the last bin also takes everything above
ENTROPY_BIN_EDGES = [i * ENTROPY_BIN_WIDTH for i in range(ENTROPY_BINS + 1)]

REQUIRED: dict[str, type | tuple[type, ...]] = {
    "variant": str, "bench": str, "question_id": str, "turn": int, "temperature": (int, float),
    "new_tokens": int, "verifier_calls": int, "accepted": list, "emitted": list, "tree_size": list,
    "wall_s": (int, float),
}
PER_STEP = ("accepted", "emitted", "tree_size", "source", "sources", "step_info", "tree_confidence_mean", "tree_entropy_mean",
            "accepted_confidence", "accepted_entropy", "rejected_count", "rejected_confidence_mean",
            "rejected_entropy_mean", "verifier_entropy_accepted", "verifier_entropy_rejected")
TRACED = ("tree_confidence_mean", "tree_entropy_mean", "accepted_confidence", "accepted_entropy", "rejected_count",
          "rejected_confidence_mean", "rejected_entropy_mean", "verifier_entropy_accepted",
          "verifier_entropy_rejected")  # the per-step fields only traced steps fill (None otherwise)
assert set(TRACED) < set(PER_STEP)


class RecordFormatError(ValueError):
    pass


def record_key(record: dict) -> tuple[str, str, float, str, int]:
    """What identifies a record: a rerun skips keys that are already written."""
    return (record["variant"], record["bench"], float(record["temperature"]), str(record["question_id"]),
            int(record["turn"]))


def conversation_key(record: dict) -> tuple[str, str, float, str]:
    """Records written together (all turns of one conversation) share this key."""
    return record_key(record)[:4]


def _entropy_bin(value: float) -> int:
    return min(ENTROPY_BINS - 1, max(0, int(value / ENTROPY_BIN_WIDTH)))


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass(frozen=True)
class TurnIdentity:
    """What a record is of, its identity fields: one turn of one question, decoded by one variant
    at one temperature. Kept apart from what the decode gave (turn_record's result and output)."""

    variant: str
    bench: str
    question_id: str
    turn: int  # 0-based
    temperature: float
    category: str
    seed: int  # the question's seed (runner.question_seed), shared by every variant
    drafters: Sequence[str]  # member names of a composed variant, in drafter-index order; () for the baseline


def turn_record(result: DecodeResult, identity: TurnIdentity, output: str) -> dict:
    """The record of one decoded turn (`output`: its decoded text). Traced steps (DecodeConfig.trace)
    fill the node statistics; untraced ones (plain decoding) leave them empty."""
    steps = result.steps
    hist = {"accepted": [0] * ENTROPY_BINS, "rejected": [0] * ENTROPY_BINS}
    per_step: dict[str, list] = {k: [] for k in PER_STEP}
    for s in steps:
        t = s.trace
        per_step["accepted"].append(s.accepted)
        per_step["emitted"].append(s.emitted)
        per_step["tree_size"].append(s.tree_size)
        per_step["source"].append(s.credited_drafter)  # the records' keys stay "source" and "sources"
        per_step["sources"].append(s.drafters)
        per_step["step_info"].append(s.info.as_json())
        if t is None:
            for k in TRACED:
                per_step[k].append(None)
            continue
        every_conf = t.accepted_confidence + t.rejected_confidence
        every_entropy = t.accepted_entropy + t.rejected_entropy
        per_step["tree_confidence_mean"].append(_mean(every_conf))
        per_step["tree_entropy_mean"].append(_mean(every_entropy))
        per_step["accepted_confidence"].append(t.accepted_confidence)
        per_step["accepted_entropy"].append(t.accepted_entropy)
        per_step["rejected_count"].append(len(t.rejected_entropy))
        per_step["rejected_confidence_mean"].append(_mean(t.rejected_confidence))
        per_step["rejected_entropy_mean"].append(_mean(t.rejected_entropy))
        per_step["verifier_entropy_accepted"].append(t.verifier_entropy_accepted)
        per_step["verifier_entropy_rejected"].append(t.verifier_entropy_rejected)
        for value in t.accepted_entropy:
            hist["accepted"][_entropy_bin(value)] += 1
        for value in t.rejected_entropy:
            hist["rejected"][_entropy_bin(value)] += 1
    split = result.time_split()
    return {
        "version": RECORD_VERSION, "variant": identity.variant, "bench": identity.bench,
        "question_id": str(identity.question_id), "turn": identity.turn, "temperature": float(identity.temperature),
        "category": identity.category, "seed": identity.seed, "drafters": list(identity.drafters),
        "new_tokens": len(result.tokens), "verifier_calls": result.verifier_calls,
        "prompt_tokens": result.prompt_tokens, "reused_prefix": result.reused_prefix,
        "stop_reason": result.stop_reason, "output": output,
        **per_step, "draft_entropy_hist": hist,
        "wall_s": result.total_s, **split, "trace_s": result.trace_s,
    }


def check_record(record: dict, where: str) -> dict:
    """Raise RecordFormatError naming `where` (file:line) if a required field is missing or wrong."""
    for key, kind in REQUIRED.items():
        if key not in record:
            raise RecordFormatError(f"{where}: missing field {key!r}")
        if not isinstance(record[key], kind) or isinstance(record[key], bool):
            raise RecordFormatError(f"{where}: field {key!r} is {type(record[key]).__name__}, expected "
                                    f"{kind.__name__ if isinstance(kind, type) else ' or '.join(k.__name__ for k in kind)}")
    if record.get("version", RECORD_VERSION) != RECORD_VERSION:
        raise RecordFormatError(f"{where}: record version {record.get('version')!r}, this TAPS reads version "
                                f"{RECORD_VERSION}")
    steps = len(record["accepted"])
    for key in ("accepted", "emitted", "tree_size"):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in record[key]):
            raise RecordFormatError(f"{where}: field {key!r} must be a list of integers")
    if record["new_tokens"] != 1 + sum(record["emitted"]):
        raise RecordFormatError(f"{where}: new_tokens is {record['new_tokens']} but the prefill's token plus the "
                                f"steps' emitted tokens make {1 + sum(record['emitted'])}")
    if record["verifier_calls"] != steps + 1:
        raise RecordFormatError(f"{where}: verifier_calls is {record['verifier_calls']} but there are {steps} steps "
                                "(expected steps + 1 for the prefill)")
    for key in PER_STEP:
        if key in record and not isinstance(record[key], list):
            raise RecordFormatError(f"{where}: field {key!r} is {type(record[key]).__name__}, expected a list with "
                                    "one entry per step")
        if key in record and len(record[key]) != steps:
            raise RecordFormatError(f"{where}: field {key!r} has {len(record[key])} entries, expected one per step "
                                    f"({steps})")
    return record


def read_records(path: str | Path) -> list[dict]:
    """Every record of one results file, checked; a torn last line (an interrupted write) is skipped."""
    try:
        rows, _torn = read_jsonl(path)
    except JsonlFormatError as err:
        raise RecordFormatError(str(err)) from None
    return [check_record(row, f"{path}: line {lineno}") for lineno, row in rows]
