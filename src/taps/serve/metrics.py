"""GET /metrics: counters, gauges and histograms in the Prometheus text format (version 0.0.4).

Per variant: requests (by endpoint and finish reason), prompt and completion tokens, accepted draft
tokens, verifier calls, decode seconds and tokens/s, the acceptance length of each response (a
histogram), the accepted length of each step (a histogram) and, per draft position d, the steps
that accepted at least d draft tokens, so alpha_d = position{d} / position{d-1} (docs/spec.md §5, with
position{0} = steps); for compositions, steps per head; for routed variants, decisions per head;
for route-bandit variants, what they learned (per context and head: rewarded pulls and mean tokens
per verifier call, read from the engine when /metrics is asked). Server-wide: rejected requests by status,
end-to-end request seconds, the queue. Written by hand: no client library needed.

Bounded: requests choose their variants (any spec of the grammar, with member names of their own),
so beyond the server's own variants only the first MAX_VARIANTS ad-hoc ones get series of their
own; later ones are counted under variant="other" (their heads under head="other"), and the page
stops growing.
"""

from __future__ import annotations

import threading

ACCEPTANCE_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)
STEP_BUCKETS = tuple(float(d) for d in range(0, 9))
SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _labels(labels: tuple) -> str:
    if not labels:
        return ""
    escaped = (f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34)).replace(chr(10), " ")}"'
               for k, v in labels)
    return "{" + ",".join(escaped) + "}"


def _number(value: float) -> str:
    return repr(float(value)) if value != int(value) else str(int(value))


class _Family:
    def __init__(self, name: str, kind: str, help_text: str, buckets: tuple[float, ...] = ()):
        self.name, self.kind, self.help, self.buckets = name, kind, help_text, buckets
        self.values: dict[tuple, object] = {}

    def add(self, labels: dict, value: float = 1.0) -> None:
        key = tuple(labels.items())
        if self.kind == "histogram":
            counts, total = self.values.get(key, ([0] * (len(self.buckets) + 1), 0.0))
            counts[next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))] += 1
            self.values[key] = (counts, total + value)
        else:
            self.values[key] = self.values.get(key, 0.0) + value

    def set(self, labels: dict, value: float) -> None:
        self.values[tuple(labels.items())] = value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        for key, value in sorted(self.values.items()):
            if self.kind != "histogram":
                lines.append(f"{self.name}{_labels(key)} {_number(value)}")
                continue
            counts, total = value
            running = 0
            for bound, count in zip([*self.buckets, float("inf")], counts):
                running += count
                le = "+Inf" if bound == float("inf") else _number(bound)
                lines.append(f"{self.name}_bucket{_labels(key + (('le', le),))} {running}")
            lines += [f"{self.name}_sum{_labels(key)} {_number(total)}", f"{self.name}_count{_labels(key)} {running}"]
        return lines


class Metrics:
    MAX_VARIANTS = 32  # ad-hoc variants with series of their own

    def __init__(self, keep=()):
        """`keep`: the server's own variant labels, which always have series of their own."""
        self._lock = threading.Lock()
        self._keep, self._adhoc = set(keep), set()
        f = self._families = {}
        for name, kind, help_text, buckets in [
            ("requests_total", "counter", "finished requests by endpoint, variant and finish reason", ()),
            ("rejected_requests_total", "counter", "requests answered with an error status before decoding", ()),
            ("prompt_tokens_total", "counter", "prompt tokens of finished requests", ()),
            ("completion_tokens_total", "counter", "generated tokens", ()),
            ("accepted_tokens_total", "counter", "draft tokens accepted by the verifier", ()),
            ("verifier_calls_total", "counter", "target forwards (the prefill counts as one)", ()),
            ("decode_seconds_total", "counter", "seconds spent decoding (queue excluded)", ()),
            ("tokens_per_second", "gauge", "completion_tokens_total / decode_seconds_total", ()),
            ("decode_phase_seconds_total", "counter", "decode seconds by phase: setup (building the proposer), "
                                                      "prefill, draft, target (tree forwards), other", ()),
            ("tree_tokens_total", "counter", "nodes verified over all steps, roots included "
                                             "(/ steps_total: the mean tree size)", ()),
            ("acceptance_length", "histogram", "per response: generated tokens / verifier calls", ACCEPTANCE_BUCKETS),
            ("step_accepted_tokens", "histogram", "per draft/verify step: accepted draft tokens", STEP_BUCKETS),
            ("steps_total", "counter", "draft/verify steps (prefill excluded)", ()),
            ("draft_position_accepted_total", "counter",
             "steps that accepted at least `position` draft tokens (alpha_d = position d / position d-1)", ()),
            ("head_steps_total", "counter", "composition steps per head (routed: the verified tree's head; "
                                            "merged: the head of the deepest accepted node, none if none)", ()),
            ("route_decisions_total", "counter", "routing decisions per chosen head (per step or per turn)", ()),
            ("bandit_pulls", "gauge", "route-bandit: rewarded decisions per context (the head the confidence prior "
                                      "favoured) and chosen head", ()),
            ("bandit_tokens_per_call", "gauge", "route-bandit: mean tokens per verifier call a head earned in a "
                                                "context (its learned reward)", ()),
            ("head_version", "gauge", "--learn: the version served per head (0: the --drafter directory)", ()),
            ("version_requests", "gauge", "--learn: requests decoded per head version", ()),
            ("version_acceptance_length", "gauge", "--learn: per head version, generated tokens / verifier calls", ()),
            ("version_tokens_per_second", "gauge", "--learn: per head version, generated tokens / decode seconds", ()),
            ("head_version_events", "gauge", "--learn: per head, versions swapped in, rolled back and refused", ()),
            ("request_duration_seconds", "histogram", "end to end, queue included", SECONDS_BUCKETS),
            ("queue_waiting", "gauge", "requests waiting for the decoder", ()),
            ("requests_running", "gauge", "requests decoding (at most one per model)", ()),
            ("queue_limit", "gauge", "waiting requests beyond which new ones get 429", ()),
        ]:
            f[name] = _Family("taps_" + name, kind, help_text, buckets)

    def _variant(self, label: str) -> str:
        """`label`, or "other" once MAX_VARIANTS ad-hoc labels have series (call under the lock)."""
        if label in self._keep or label in self._adhoc:
            return label
        if len(self._adhoc) < self.MAX_VARIANTS:
            self._adhoc.add(label)
            return label
        return "other"

    def reject(self, status: int) -> None:
        with self._lock:
            self._families["rejected_requests_total"].add({"status": str(status)})

    def finished(self, endpoint: str, variant, outcome, finish: str, seconds: float) -> None:
        """One decoded request (stopped or cancelled too): its tokens, steps and timings."""
        f = self._families
        with self._lock:
            v = {"variant": self._variant(variant.label)}
            other = v["variant"] == "other"
            f["requests_total"].add({"endpoint": endpoint, **v, "finish": finish})
            f["request_duration_seconds"].add({"endpoint": endpoint}, seconds)
            f["prompt_tokens_total"].add(v, outcome.prompt_tokens)
            f["completion_tokens_total"].add(v, len(outcome.tokens))
            f["accepted_tokens_total"].add(v, outcome.accepted_tokens)
            f["verifier_calls_total"].add(v, outcome.verifier_calls)
            f["decode_seconds_total"].add(v, outcome.decode_s)
            for phase, seconds_in in outcome.seconds.items():
                f["decode_phase_seconds_total"].add({**v, "phase": phase}, seconds_in)
            f["tree_tokens_total"].add(v, sum(outcome.tree_tokens))
            key = tuple(v.items())
            seconds_total = f["decode_seconds_total"].values[key]
            if seconds_total > 0:
                f["tokens_per_second"].set(v, f["completion_tokens_total"].values[key] / seconds_total)
            if outcome.tokens:
                f["acceptance_length"].add(v, outcome.acceptance_length)
            f["steps_total"].add(v, len(outcome.accepted))
            for accepted in outcome.accepted:
                f["step_accepted_tokens"].add(v, accepted)
                for d in range(1, accepted + 1):
                    f["draft_position_accepted_total"].add({**v, "position": str(d)})
            if variant.composition:
                for head in outcome.heads:
                    f["head_steps_total"].add({**v, "head": "other" if other else head or "none"})
            for decision in outcome.decisions:
                f["route_decisions_total"].add({**v, "head": "other" if other else decision["head"]})

    def failed(self, endpoint: str, variant_label: str, seconds: float) -> None:
        with self._lock:
            self._families["requests_total"].add({"endpoint": endpoint, "variant": self._variant(variant_label),
                                                  "finish": "error"})
            self._families["request_duration_seconds"].add({"endpoint": endpoint}, seconds)

    def render(self, waiting: int, running: int, limit: int, learned: list[dict] = (),
               versions: list[tuple[str, dict, float]] = ()) -> str:
        """The page; `learned`: the engine's route-bandit states (Engine.learned); `versions`: the
        head versions' figures (serve/swap.HeadSwapper.rows)."""
        with self._lock:
            f = self._families
            for family, labels, value in versions:
                f[family].set(labels, value)
            for row in learned:
                if self._variant(row["variant"]) == "other":
                    continue  # a gauge per context and head of a variant without series of its own: none
                labels = {"variant": row["variant"], "context": row["context"], "head": row["head"]}
                f["bandit_pulls"].set(labels, row["pulls"])
                if row["tokens_per_call"] is not None:
                    f["bandit_tokens_per_call"].set(labels, row["tokens_per_call"])
            f["queue_waiting"].set({}, waiting)
            f["requests_running"].set({}, running)
            f["queue_limit"].set({}, limit)
            return "\n".join(line for family in f.values() for line in family.render()) + "\n"


def parse(text: str) -> dict[str, dict[tuple, float]]:
    """The samples of a Prometheus text page: name -> {sorted label pairs: value} (for tests, bench)."""
    import re

    samples: dict[str, dict[tuple, float]] = {}
    pattern = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = pattern.match(line)
        if match is None:
            raise ValueError(f"not a Prometheus sample line: {line!r}")
        name, _, labels, value = match.groups()
        pairs = tuple(sorted(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', labels or "")))
        samples.setdefault(name, {})[pairs] = float(value)
    return samples
