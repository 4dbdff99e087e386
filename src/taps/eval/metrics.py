"""The study's metrics, computed from results records (docs/spec.md §5) and nothing else.

Every function is pure: it takes a list of record dicts (taps.eval.records) and returns numbers,
so the report, the tests and an ad-hoc notebook all compute the same thing the same way.

Conventions (docs/spec.md §5), stated once:
- a step is one verifier call on a tree; the prefill is a verifier call too and emits the first
  token, so a record's new_tokens = 1 + sum(emitted) and verifier_calls = steps + 1;
- acceptance length tau = new tokens / verifier calls, pooled: each step contributes its accepted
  draft tokens + 1 (the bonus), so plain decoding scores exactly 1.0. Nothing divides by steps - 1;
- records without per-step node statistics (untraced, plain decoding) hold None there, which every
  entropy / confidence metric skips.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

from taps.eval.records import ENTROPY_BIN_EDGES, ENTROPY_BINS, conversation_key, read_records, record_key
from taps.propose.spec import TREE_SIGNALS

BASELINE = "baseline"  # the variant name of plain decoding, the reference of every speedup
AVERAGE = "average"  # the bench name of the paper's Average column (add_benchmark_average)

NAN = float("nan")


# ---- loading -------------------------------------------------------------------------------------
def load_results(results_dir: str | Path) -> list[dict]:
    """Every record of one results directory: records.jsonl plus shards/*.jsonl, sorted by key.

    A shard that was merged into records.jsonl may still be on disk, so a key seen twice with the
    same outcome is kept once; the same key with a different outcome (accepted steps or new_tokens)
    means two runs disagree, and that is an error naming both files rather than a silent pick.
    """
    root = Path(results_dir)
    files = [root / "records.jsonl"] + sorted((root / "shards").glob("*.jsonl"))
    seen: dict[tuple, tuple[dict, Path]] = {}
    for path in files:
        if not path.is_file():
            continue
        for record in read_records(path):
            key = record_key(record)
            if key in seen:
                first, first_path = seen[key]
                if first["accepted"] != record["accepted"] or first["new_tokens"] != record["new_tokens"]:
                    raise ValueError(f"conflicting records for {key}: {first_path} and {path} disagree on the "
                                     "accepted steps or new_tokens (two different runs wrote the same key)")
                continue
            seen[key] = (record, path)
    if not seen:
        raise FileNotFoundError(f"no results records in {root} (looked for records.jsonl and shards/*.jsonl)")
    return [seen[key][0] for key in sorted(seen)]


# ---- acceptance ----------------------------------------------------------------------------------
def _require(records: Sequence[dict], what: str) -> None:
    if not records:
        raise ValueError(f"{what}: no records")


def acceptance_length(records: Sequence[dict]) -> float:
    """Pooled tau = sum(new_tokens) / sum(verifier_calls) (docs/spec.md §5); plain decoding gives 1.0.

    Pooled over every step of every record, so long answers weigh by their length, as the paper's
    per-benchmark numbers do."""
    _require(records, "acceptance_length")
    return sum(r["new_tokens"] for r in records) / sum(r["verifier_calls"] for r in records)


def per_question_acceptance(records: Sequence[dict]) -> float:
    """Mean over questions of each question's tau, its turns pooled (docs/spec.md §5: the per-question mean).

    A question is a conversation (variant, bench, temperature, question_id): within one run that is
    (bench, question_id); the extra fields only keep different runs apart in a mixed list."""
    _require(records, "per_question_acceptance")
    tokens: dict[tuple, int] = defaultdict(int)
    calls: dict[tuple, int] = defaultdict(int)
    for r in records:
        key = conversation_key(r)
        tokens[key] += r["new_tokens"]
        calls[key] += r["verifier_calls"]
    return sum(tokens[k] / calls[k] for k in tokens) / len(tokens)


def _accepted_lengths(records: Iterable[dict]) -> list[int]:
    return [a for r in records for a in r["accepted"]]


def accepted_length_histogram(records: Sequence[dict]) -> list[int]:
    """counts[a] = number of steps that accepted exactly a draft tokens (a = 0..max seen)."""
    lengths = _accepted_lengths(records)
    counts = [0] * (max(lengths) + 1 if lengths else 0)
    for a in lengths:
        counts[a] += 1
    return counts


def acceptance_by_depth(records: Sequence[dict], depth: int | None = None) -> list[float]:
    """[alpha_1 .. alpha_depth], alpha_d = #steps accepting >= d / #steps accepting >= d-1 (docs/spec.md §5).

    The conditional rate of accepting the d-th draft token given the first d-1 were accepted, over
    all steps; depth defaults to the longest acceptance seen; a zero denominator gives nan."""
    counts = accepted_length_histogram(records)
    depth = max(len(counts) - 1, 0) if depth is None else depth
    if depth < 0:
        raise ValueError(f"acceptance_by_depth: depth must be >= 0, got {depth}")
    at_least = [sum(counts[d:]) for d in range(depth + 1)]  # at_least[d] = #steps with accepted >= d
    return [at_least[d] / at_least[d - 1] if at_least[d - 1] else NAN for d in range(1, depth + 1)]


# ---- entropy -------------------------------------------------------------------------------------
def _steps(record: dict, key: str) -> list:
    """A per-step list, or all None when the record does not have it (an older / minimal record)."""
    values = record.get(key)
    return values if values is not None else [None] * len(record["accepted"])


def _mean_or_nan(total: float, count: int) -> float:
    return total / count if count else NAN


def entropy_summary(records: Sequence[dict]) -> dict:
    """Accepted vs rejected entropies (docs/spec.md §5), as node-level means and histograms.

    draft_entropy_*: the head's entropy at the accepted-path nodes vs every other node of the same
    trees (the rejected mean is weighted by each step's rejected_count, so it is a mean over nodes);
    verifier_entropy_*: the target's entropy where a draft token was accepted vs the first rejected
    position (a leaf has none). n_* are the node / position counts behind each mean; untraced steps
    (None) are skipped; a mean over nothing is nan. hist_*: element-wise sums of draft_entropy_hist.
    """
    acc_sum = rej_sum = ver_acc_sum = ver_rej_sum = 0.0
    acc_n = rej_n = ver_acc_n = ver_rej_n = 0
    hist = {"accepted": [0] * ENTROPY_BINS, "rejected": [0] * ENTROPY_BINS}
    for r in records:
        for values in _steps(r, "accepted_entropy"):
            if values is not None:
                acc_sum += sum(values)
                acc_n += len(values)
        for mean, count in zip(_steps(r, "rejected_entropy_mean"), _steps(r, "rejected_count")):
            if mean is not None and count:
                rej_sum += mean * count
                rej_n += count
        for values in _steps(r, "verifier_entropy_accepted"):
            if values is not None:
                ver_acc_sum += sum(values)
                ver_acc_n += len(values)
        for value in _steps(r, "verifier_entropy_rejected"):
            if value is not None:
                ver_rej_sum += value
                ver_rej_n += 1
        record_hist = r.get("draft_entropy_hist")
        if record_hist:
            for side in ("accepted", "rejected"):
                counts = record_hist[side]
                if len(counts) != ENTROPY_BINS:
                    raise ValueError(f"record {record_key(r)}: draft_entropy_hist[{side!r}] has {len(counts)} bins, "
                                     f"expected {ENTROPY_BINS}")
                hist[side] = [a + b for a, b in zip(hist[side], counts)]
    return {
        "draft_entropy_accepted": _mean_or_nan(acc_sum, acc_n), "n_draft_accepted": acc_n,
        "draft_entropy_rejected": _mean_or_nan(rej_sum, rej_n), "n_draft_rejected": rej_n,
        "verifier_entropy_accepted": _mean_or_nan(ver_acc_sum, ver_acc_n), "n_verifier_accepted": ver_acc_n,
        "verifier_entropy_rejected": _mean_or_nan(ver_rej_sum, ver_rej_n), "n_verifier_rejected": ver_rej_n,
        "hist_accepted": hist["accepted"], "hist_rejected": hist["rejected"],
        "bin_edges": list(ENTROPY_BIN_EDGES),
    }


# ---- routing -------------------------------------------------------------------------------------
def _drafter_name(record: dict, chosen: int) -> str:
    drafters = record.get("drafters") or []
    if not 0 <= chosen < len(drafters):
        raise ValueError(f"record {record_key(record)}: route_chosen {chosen} but the record names "
                         f"{len(drafters)} drafters {drafters}")
    return drafters[chosen]


def _shares(counts: dict[str, int], names: Sequence[str] | None) -> dict[str, float]:
    keys = list(names) if names is not None else list(counts)
    unknown = set(counts) - set(keys)
    if unknown:
        raise ValueError(f"drafters {sorted(unknown)} were chosen but are not among names {keys}")
    total = sum(counts.values())
    return {k: counts.get(k, 0) / total if total else NAN for k in keys}


def routing_counts(records: Sequence[dict]) -> dict[str, int]:
    """Steps verified with each drafter's tree, over every routed step (route_chosen set), by name;
    names in order of first appearance in the records' drafters lists."""
    counts: dict[str, int] = {}
    for r in records:
        for info in _steps(r, "step_info"):
            chosen = (info or {}).get("route_chosen")
            if chosen is None:
                continue
            for name in r.get("drafters") or []:
                counts.setdefault(name, 0)
            counts[_drafter_name(r, chosen)] += 1
    return counts


def routing_shares(records: Sequence[dict], names: Sequence[str] | None = None) -> dict[str, float]:
    """The causal routing share: of every step a router decided, the share verified with each drafter.

    This is what a routed decoder actually did (unlike posthoc_routing, which only asks which head
    would have won). names fixes the keys and their order (a drafter never chosen gets 0.0); a
    chosen drafter outside names is an error. No routed step: every share is nan."""
    return _shares(routing_counts(records), names)


def turn_routing_counts(records: Sequence[dict]) -> dict[str, int]:
    """Turns (records) decided for each drafter by a per-turn router: the first step's route_chosen.
    A record whose steps chose different drafters is not per-turn routed, and is an error."""
    counts: dict[str, int] = {}
    for r in records:
        chosen = [(info or {}).get("route_chosen") for info in _steps(r, "step_info")]
        chosen = [c for c in chosen if c is not None]
        if not chosen:
            continue
        if any(c != chosen[0] for c in chosen):
            raise ValueError(f"record {record_key(r)} switches drafters within the turn: it is not per-turn "
                             "routed (use routing_shares)")
        for name in r.get("drafters") or []:
            counts.setdefault(name, 0)
        counts[_drafter_name(r, chosen[0])] += 1
    return counts


def turn_routing_shares(records: Sequence[dict], names: Sequence[str] | None = None) -> dict[str, float]:
    """Share of turns decided for each drafter by a per-turn (entropy probe) router; names as in
    routing_shares. Turns with no step (no decision made) are not counted."""
    return _shares(turn_routing_counts(records), names)


def _question(record: dict) -> tuple[str, float, str]:
    return record["bench"], float(record["temperature"]), str(record["question_id"])


def _head_scores(records: Sequence[dict], signal: str) -> dict[tuple, float | None]:
    """Per question: the node-weighted mean of the signal over every logged node of all its turns."""
    field = "tree_confidence_mean" if signal == "confidence" else "tree_entropy_mean"
    total: dict[tuple, float] = defaultdict(float)
    nodes: dict[tuple, int] = defaultdict(int)
    for r in records:
        q = _question(r)
        nodes[q] += 0
        for value, size in zip(_steps(r, field), r["tree_size"]):
            if value is not None and size > 1:
                total[q] += value * (size - 1)
                nodes[q] += size - 1
    return {q: total[q] / nodes[q] if nodes[q] else None for q in nodes}


def posthoc_decisions(records_by_head: dict[str, Sequence[dict]], signal: str) -> dict[tuple[str, float, str], str]:
    """Paper Table 2's decisions: for each question, the head a whole-generation router would pick.

    records_by_head maps a head name to the records of its own single-head variant. A question
    (bench, temperature, question_id) counts if every head has it; a head's score is the mean of
    the signal over all logged (non-root) nodes of its whole generation (all turns), i.e. the tree
    means weighted by tree_size - 1. "confidence": highest wins; "entropy": lowest wins; ties go to
    the first head in dict order. A question where a head logged no node scores it as a root-only
    tree does in the live router (confidence 0, entropy inf); a head with no logged node at all
    was not traced, and is an error."""
    if signal not in TREE_SIGNALS:
        raise ValueError(f"unknown routing signal {signal!r}; expected one of {', '.join(TREE_SIGNALS)}")
    if not records_by_head:
        raise ValueError("posthoc_decisions: no heads")
    scores = {head: _head_scores(records, signal) for head, records in records_by_head.items()}
    for head, per_q in scores.items():
        if per_q and all(s is None for s in per_q.values()):
            raise ValueError(f"head {head!r}: no logged tree statistics in its records (decode with trace=True)")
    common = set.intersection(*(set(per_q) for per_q in scores.values()))
    if not common:
        raise ValueError(f"no question is present for every head ({', '.join(records_by_head)})")
    missing = 0.0 if signal == "confidence" else math.inf
    sign = 1.0 if signal == "confidence" else -1.0
    decisions = {}
    for q in sorted(common):
        best, best_score = None, None
        for head, per_q in scores.items():
            score = sign * (per_q[q] if per_q[q] is not None else missing)
            if best is None or score > best_score:  # strict: ties stay with the earlier head
                best, best_score = head, score
        decisions[q] = best
    return decisions


def posthoc_routing(records_by_head: dict[str, Sequence[dict]], signal: str) -> dict[str, float]:
    """Paper Table 2: the share of questions each head wins under `signal` (see posthoc_decisions,
    whose length is the number of questions the shares are over). Keys in records_by_head order."""
    decisions = posthoc_decisions(records_by_head, signal)
    return {head: sum(w == head for w in decisions.values()) / len(decisions) for head in records_by_head}


# ---- speed ---------------------------------------------------------------------------------------
def tokens_per_second(records: Sequence[dict]) -> float:
    """Pooled wall-clock throughput sum(new_tokens) / sum(wall_s) (prefill included, tracing not)."""
    _require(records, "tokens_per_second")
    seconds = sum(r["wall_s"] for r in records)
    return sum(r["new_tokens"] for r in records) / seconds if seconds > 0 else math.inf


def _turn(record: dict) -> tuple[str, str, int, float]:
    return record["bench"], str(record["question_id"]), int(record["turn"]), float(record["temperature"])


def speedup(records: Sequence[dict], baseline_records: Sequence[dict]) -> float:
    """tokens/s of `records` over tokens/s of plain decoding (docs/spec.md §5), over the turns both have.

    Only (bench, question_id, turn, temperature) present on both sides count, so a partial run is
    compared with the same prompts, not with a different mix of short and long answers."""
    both = {_turn(r) for r in records} & {_turn(r) for r in baseline_records}
    if not both:
        raise ValueError("speedup: the records and the baseline share no (bench, question_id, turn, temperature)")
    ours = [r for r in records if _turn(r) in both]
    base = [r for r in baseline_records if _turn(r) in both]
    return tokens_per_second(ours) / tokens_per_second(base)


# ---- tables --------------------------------------------------------------------------------------
def _group_value(record: dict, field: str):
    value = record[field]
    return float(value) if field == "temperature" else value


def summarize(records: Sequence[dict], by: Sequence[str] = ("variant", "bench", "temperature"),
              baseline: str = BASELINE) -> list[dict]:
    """One tidy row per group (sorted by the group fields): the group fields, questions, records,
    steps, new_tokens, acceptance_length (pooled), per_question_acceptance, tokens_per_second and
    speedup over the `baseline` variant's records that agree on every other group field (compared
    over the shared turns; None when there is no such baseline or "variant" is not grouped on)."""
    by = tuple(by)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[tuple(_group_value(r, f) for f in by)].append(r)
    rows = []
    for key in sorted(groups, key=_sort_key):
        group = groups[key]
        row = dict(zip(by, key))
        row.update(questions=len({conversation_key(r) for r in group}), records=len(group),
                   steps=sum(len(r["accepted"]) for r in group), new_tokens=sum(r["new_tokens"] for r in group),
                   acceptance_length=acceptance_length(group), per_question_acceptance=per_question_acceptance(group),
                   tokens_per_second=tokens_per_second(group), speedup=None)
        if "variant" in by:
            i = by.index("variant")
            base_key = key[:i] + (baseline,) + key[i + 1:]
            base = groups.get(base_key)
            if base:
                try:
                    row["speedup"] = speedup(group, base)
                except ValueError:  # no shared turns yet
                    pass
        rows.append(row)
    return rows


def _sort_key(key: tuple) -> tuple:
    """Numbers before text, so a group field holding None or mixed types still sorts."""
    return tuple((0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v)) for v in key)


def add_benchmark_average(rows: Sequence[dict], benches: Sequence[str] | None = None) -> list[dict]:
    """rows (summarize grouped by variant, bench, temperature) plus one bench="average" row per
    (variant, temperature), as the paper's Average column.

    The paper's Average is the unweighted mean of the per-benchmark acceptance lengths (each
    benchmark counts once, however many tokens it has), so acceptance_length,
    per_question_acceptance, tokens_per_second and speedup are unweighted means of the benchmark
    rows (speedup None unless every benchmark has one); questions, records, steps and new_tokens
    are sums. benches: average exactly these, and skip a (variant, temperature) that lacks any of
    them, so averages in one table are over the same benchmarks; None: whatever each group has."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        if row["bench"] == AVERAGE:
            continue
        if benches is None or row["bench"] in benches:
            groups[(row["variant"], row["temperature"])].append(row)
    out = list(rows)
    for (variant, temperature), group in groups.items():
        if benches is not None and {row["bench"] for row in group} != set(benches):
            continue
        avg = {key: None for key in group[0]}
        avg.update(variant=variant, bench=AVERAGE, temperature=temperature)
        for key in ("questions", "records", "steps", "new_tokens"):
            avg[key] = sum(row[key] for row in group)
        for key in ("acceptance_length", "per_question_acceptance", "tokens_per_second", "speedup"):
            values = [row.get(key) for row in group]
            avg[key] = sum(values) / len(values) if all(v is not None for v in values) else None
        out.append(avg)
    return out
