"""The server's one door into the decoding library: the target, its heads, the variants a request
may name, and one decode with its tokens passed on as the verifier accepts them.

Nothing else in taps.serve imports the decoder, the proposers or the variant grammar, so a change
of their API touches this file only.

Variants. A request names one in `extra_body.taps.variant`, or gets the server's default:
  - `baseline` (also `plain`): plain decoding of the target;
  - a drafter's name (`--drafter NAME=DIR`): that head alone;
  - a name given with `--variant NAME=SPEC`;
  - any SPEC of the composition grammar (taps.propose.spec), e.g. `route-entropy-turn:math,chat`
    or `merge-trie:math,chat,lookup`, whose members are drafter names or `lookup`. A request can
    never name a directory: only the heads the server was started with are loaded.

Streaming. The decode loop's per-step hook (decode.OnStep) hands each step's tokens to a
callback as soon as the target accepts them (the prefill's first token too), and stops the decode
between two steps when asked (a client gone, a stop string seen, shutdown): the decoder then ends
with stop_reason "cancelled". The proposer is the variant's own, untouched.

Routing. A routed variant's decisions (the steps whose record, StepStats.info, holds routing
scores: every step, or a turn's first) come back in Outcome.decisions and are logged, one JSON
line per decision, on the logger `taps.serve.routing` (`taps serve --log-level info` prints them). A `route-bandit` variant
learns across requests: the HeadPool keeps its state (propose/bandit.BanditState) per variant,
every request's proposer reads and updates it, and `learned()` reports it for /metrics.

Remembered estimates. Every variant's drafters start a request from the running estimates earlier
requests taught them (`--tree auto`'s calibrations, lookup's acceptance rates: propose/memory.py),
warm, not frozen; a request with `learn = false` starts cold and teaches them nothing.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from taps.core.config import DecodeConfig, SamplingConfig, SpeculationConfig
from taps.core.decode import DecodeResult, StepStats, chat_ids, generate, reply_text
from taps.drafter.profile import tree_policy
from taps.propose.factory import HeadPool
from taps.propose.spec import LOOKUP, VariantSpec, VariantSpecError, parse_spec
from taps.core.target import TargetRef

PLAIN_NAMES = ("baseline", "plain")
ROUTING_LOG = logging.getLogger("taps.serve.routing")


class VariantError(ValueError):
    """A variant the server cannot serve (unknown name, bad spec, a member that is not a served head)."""


@dataclass(frozen=True)
class Variant:
    label: str  # what requests and /metrics call it
    spec: VariantSpec  # members bound to the served drafter directories

    @property
    def members(self) -> list[str]:
        return self.spec.member_names

    @property
    def composition(self) -> bool:
        return self.spec.strategy in ("route", "merge")


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class Outcome:
    """One decode: its new tokens and the figures `usage` and /metrics report."""

    tokens: list[int]
    prompt_tokens: int
    finish: str  # "stop_token" | "max_new_tokens" | "cancelled"
    verifier_calls: int
    accepted: list[int]  # accepted draft tokens per step
    heads: list[str | None]  # per step: the head whose tree was verified (routing) or accepted deepest
    decode_s: float
    decisions: list[dict] = field(default_factory=list)  # a routed variant's decisions (decision_record)
    # where decode_s went (phase_seconds: DecodeResult.time_split plus "setup", building the
    # proposer), and the nodes verified per step (the root counts)
    seconds: dict[str, float] = field(default_factory=dict)
    tree_tokens: list[int] = field(default_factory=list)

    @property
    def accepted_tokens(self) -> int:
        return sum(self.accepted)

    @property
    def acceptance_length(self) -> float:
        return len(self.tokens) / self.verifier_calls if self.verifier_calls else 0.0


def phase_seconds(result: DecodeResult, setup_s: float) -> dict[str, float]:
    """A decode's seconds by phase: building the proposer, the prefill, drafting, the target's tree
    forwards, verification and bookkeeping (DecodeResult.time_split)."""
    split = result.time_split()
    return {"setup": setup_s, "prefill": split["prefill_s"], "draft": split["draft_s"],
            "target": split["target_s"], "other": split["other_s"]}


def _step_head(step: StepStats, names: Sequence[str]) -> str | None:
    """The head a step belongs to: the routed one if the proposer routed, else the drafter of the
    deepest accepted node (None when no draft token was accepted)."""
    index = step.info.route_chosen
    if index is None:
        index = step.credited_drafter
    return names[index] if 0 <= index < len(names) else None


class Engine:
    """One target, its heads (loaded once) and the variants it serves; decodes one request at a time
    (the caller serialises: taps.serve.app holds one lock per engine)."""

    def __init__(self, target, drafters: Sequence[tuple[str, str]] = (), variants: Sequence[str] = (),
                 speculation: SpeculationConfig = SpeculationConfig(), model_id: str | None = None,
                 attn_implementation: str = "sdpa"):
        if target.tokenizer is None:
            raise ValueError("the target has no tokenizer; taps serve needs one to read prompts and write text")
        self.target, self.speculation, self.tree = target, speculation, speculation.tree
        self.model_id = model_id or short_name(getattr(target, "name", None) or "taps-target")
        names = [n for n, _ in drafters]
        if len(set(names)) != len(names):
            raise ValueError(f"--drafter names must be distinct, got {', '.join(names)}; name them NAME=DIR")
        clash = [n for n in names if n in PLAIN_NAMES]
        if clash:
            raise ValueError(f"--drafter name {clash[0]!r} is reserved for plain decoding; name the head otherwise")
        self.drafters = dict(drafters)
        self.pool = HeadPool(target, attn_implementation, remember=True)
        for name, path in drafters:  # load every head now: a bad directory fails at startup, not per request
            self.pool.head(path)
        self.stop = target.stop_token_ids()
        self.named: dict[str, Variant] = {n: Variant(n, VariantSpec(n, "baseline")) for n in PLAIN_NAMES}
        self.named.update({n: self._bind(n, n, "--drafter") for n in self.drafters})
        self._adhoc: dict[str, Variant] = {}
        default = None
        for text in variants:
            name, spec = _named_spec(text)
            variant = self._bind(name, spec, "--variant")
            self.named[name] = variant
            default = default or variant
        if default is None and len(names) > 1:  # several heads: confidence routing over all of them
            default = self._bind("route", "route:" + ",".join(names), "--drafter")
            self.named.setdefault("route", default)
        elif default is None:
            default = self.named[names[0] if names else "baseline"]
        self.default = default
        self.policy = tree_policy(target, (self.pool.head(p) for _, p in drafters), speculation)
        for variant in {id(v): v for v in self.named.values()}.values():  # averages are computed once, now
            self.pool.proposer(variant.spec, self.tree, self.policy)

    @classmethod
    def load(cls, target: TargetRef, drafters: Sequence[tuple[str, str]] = (), variants: Sequence[str] = (),
             speculation: SpeculationConfig = SpeculationConfig(), model_id: str | None = None) -> "Engine":
        return cls(target.load(), drafters, variants, speculation, model_id, target.attn)

    # ---- facts -----------------------------------------------------------------------------
    @property
    def context_window(self) -> int:
        return self.target.context_window

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for (its longest vocabulary entry: byte-level
        entries have one character per byte): a text longer than n times this has more than n
        tokens, so the server refuses it without tokenising it."""
        return max(len(entry) for entry in self.target.tokenizer.get_vocab())

    def describe(self) -> dict:
        return {"drafters": list(self.drafters), "variants": sorted(self.named), "default_variant": self.default.label,
                "context_window": self.context_window, "tree": {**asdict(self.tree), "auto": self.speculation.auto}}

    # ---- variants ----------------------------------------------------------------------------
    def _bind(self, label: str, spec_text: str, where: str) -> Variant:
        """A variant whose members name served drafters (or lookup), bound to their directories."""
        try:
            spec = parse_spec(label, spec_text)
        except VariantSpecError as err:
            raise VariantError(f"{where} {spec_text!r}: {err}") from None
        members = []
        for name, path in spec.drafters:
            if path in self.drafters:
                members.append((name, self.drafters[path]))
            elif path == LOOKUP:
                members.append((name, LOOKUP))
            else:
                served = ", ".join([*self.drafters, LOOKUP])
                raise VariantError(f"{where} {spec_text!r}: {path!r} is not a served drafter; expected one of "
                                   f"{served} (or baseline)")
        try:
            return Variant(label, replace(spec, drafters=tuple(members)))
        except VariantSpecError as err:
            raise VariantError(f"{where} {spec_text!r}: {err}") from None

    def resolve(self, text: str | None) -> Variant:
        """The variant a request names (None: the server's default)."""
        if text is None:
            return self.default
        text = text.strip()
        if text in self.named:
            return self.named[text]
        if text not in self._adhoc:
            variant = self._bind(text, text, "variant")
            if variant.spec.strategy == "average":
                self.pool.proposer(variant.spec, self.tree, self.policy)  # the average, computed once
            if len(self._adhoc) >= 256:  # bounded: requests choose the keys
                self.pool.forget(self._adhoc.pop(next(iter(self._adhoc))).spec)  # and what it learned
            self._adhoc[text] = variant
        return self._adhoc[text]

    # ---- text ----------------------------------------------------------------------------------
    def chat_prompt(self, messages: list[dict]) -> list[int]:
        return chat_ids(self.target.tokenizer, messages)

    def text_prompt(self, text: str) -> list[int]:
        return self.target.tokenizer(text)["input_ids"]

    def detokenize(self, tokens: list[int]) -> str:
        """As `taps generate` prints them: stop tokens and special tokens left out."""
        return reply_text(self.target.tokenizer, tokens, self.stop)

    # ---- decoding ----------------------------------------------------------------------------
    def decode(self, prompt: list[int], variant: Variant, sampling: Sampling,
               on_tokens: Callable[[list[int]], None] = lambda tokens: None,
               cancelled: Callable[[], bool] = lambda: False, remember: bool = True) -> Outcome:
        """Decode one continuation (blocking); `on_tokens` gets each step's tokens as soon as they are
        accepted, and `cancelled` is polled after each (a true answer ends the decode there);
        `remember`: the drafters' running estimates start from, and add to, what earlier requests
        to the variant taught them (false: from their cold priors, nothing kept)."""
        cfg = DecodeConfig(max_new_tokens=sampling.max_tokens, stop_token_ids=self.stop, seed=sampling.seed,
                           sampling=SamplingConfig(sampling.temperature, sampling.top_p))

        def on_step(tokens: list[int], step: StepStats | None) -> bool:
            on_tokens(list(tokens))
            return cancelled()

        start = time.perf_counter()
        proposer = self.pool.proposer(variant.spec, self.tree, self.policy, remember=remember)
        built = time.perf_counter()
        result = generate(self.target, proposer, prompt, cfg, on_step=on_step)
        steps, names = result.steps, variant.members
        outcome = Outcome(result.tokens, result.prompt_tokens, result.stop_reason, result.verifier_calls,
                          [s.accepted for s in steps], [_step_head(s, names) for s in steps],
                          time.perf_counter() - start, seconds=phase_seconds(result, built - start),
                          tree_tokens=[s.tree_size for s in steps])
        outcome.decisions = [decision_record(variant, i, s) for i, s in enumerate(steps)
                             if s.info.route_scores is not None]
        for record in outcome.decisions:
            ROUTING_LOG.info(json.dumps(record))
        return outcome

    def learned(self) -> list[dict]:
        """What every route-bandit variant has learned so far: per variant, context and head, the
        rewarded pulls and their mean tokens per verifier call."""
        labels = {HeadPool.learned_key(v.spec): v.label for v in [*self.named.values(), *self._adhoc.values()]}
        return [{"variant": labels[key], **row} for key, state in list(self.pool.learned.items()) if key in labels
                for row in state.summary()]


def decision_record(variant: Variant, index: int, step: StepStats) -> dict:
    """The routing decision of step `index` (its record holds the scores: propose/routed.RouteDecision.info)
    as the log line and Outcome hold it."""
    names, info = variant.members, step.info
    record = {"variant": variant.label, "signal": variant.spec.signal, "step": index,
              "head": names[info.route_chosen], "scores": [round(x, 6) for x in info.route_scores]}
    if info.route_prior is not None:
        record.update(prior=[round(x, 6) for x in info.route_prior], context=names[info.route_context])
    return record


def short_name(name: str) -> str:
    """The model id a server shows for a target loaded from `name`: a path's last component (no
    directories of the server's disk in /v1/models), a known name as it is."""
    return Path(name.rstrip("/\\")).name or name


def _named_spec(text: str) -> tuple[str, str]:
    """`--variant NAME=SPEC` or a bare SPEC (named by itself). A SPEC's members may hold `=` too
    (route:m=DIR), so NAME is what precedes the first `=` only if it has no `:`, `,` or `/`."""
    name, sep, spec = text.partition("=")
    if sep and name and spec and not any(c in name for c in ":,/"):
        return name.strip(), spec.strip()
    return text.strip(), text.strip()
