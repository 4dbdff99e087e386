"""Greedy acceptance by replay: a proposer's trees walked along the target's own greedy
continuation, with no tree forward.

Why: at temperature 0 verification (core/verify.py) accepts, at each node, the child whose token is
the target's argmax there, and on the accepted path that argmax is the next token of the target's
plain greedy decoding: greedy speculative output is plain greedy output (token-identical in
float32). So a drafter's greedy acceptance can be read off without verifying any tree: decode the
target plainly once, run one prefill over prompt + continuation for the target's features (what a
head consumes for the accepted tokens) and logits, then let each proposer draft its trees and walk
them along the continuation. In a study's decoding the tree forwards are most of the time (79 % of
`make demo`'s decode time on a 2-core AMD EPYC without AMX, with the paper's 60-node trees:
docs/long-context.md), and one reference serves every variant of a question.

What it measures is acceptance, not speed: a replayed step has no target forward (its target_s is
0). It equals real decoding's accepted lengths, tokens and traces wherever real greedy decoding is
token-identical to plain decoding, which is always in exact arithmetic and in float32 on every test;
in bf16 a tree forward rounds differently from a one-token forward and real decoding can leave the
plain continuation at a near-tie, where replay keeps scoring against it (tests/test_replay.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from taps.core.config import DecodeConfig
from taps.core.decode import ChatSession, DecodeResult, StepStats, _common_prefix, _cut, _rooted_at, generate
from taps.core.proposer import Proposer
from taps.core.stopwatch import Stopwatch
from taps.core.target import Target
from taps.core.trace import path_trace
from taps.core.verify import verify_along


@dataclass(frozen=True)
class Reference:
    """The target's greedy continuation of one context, and its forward at every position."""

    context: list[int]  # the prompt ids
    tokens: list[int]  # the greedy continuation, the prefill's token first
    features: Tensor  # [C + T, F] the target's features at every position of context + tokens
    logits: Tensor | None  # [T, V] its logits at the continuation's positions (kept only for traces)
    stop_reason: str  # the plain decode's


def greedy_reference(target: Target, context: list[int], cfg: DecodeConfig) -> Reference:
    """Decode `context` plainly (greedy) and read the target's features (and, with cfg.trace, its
    logits) at every position of context + continuation from one prefill."""
    if not cfg.sampling.greedy:
        raise ValueError("a replay reference is the greedy continuation: temperature must be 0")
    plain = generate(target, None, context, cfg)
    target.reset()
    out = target.prefill(torch.tensor(context + plain.tokens, dtype=torch.long), all_logits=cfg.trace)
    target.reset()
    logits = out.logits[len(context):] if cfg.trace else None  # a trace reads none of the prompt's
    return Reference(context=list(context), tokens=list(plain.tokens), features=out.features, logits=logits,
                     stop_reason=plain.stop_reason)


def replay(proposer: Proposer, ref: Reference, cfg: DecodeConfig) -> DecodeResult:
    """Decode `ref.context` with `proposer` at temperature 0, each tree accepted along ref's greedy
    continuation instead of verified (module docstring); the result's steps are real decoding's
    in everything but the target's time (0)."""
    if not cfg.sampling.greedy:
        raise ValueError("replay measures greedy acceptance: temperature must be 0")
    if cfg.max_new_tokens > len(ref.tokens) and ref.stop_reason == "max_new_tokens":
        raise ValueError(f"the reference continues {len(ref.tokens)} tokens, fewer than max_new_tokens "
                         f"{cfg.max_new_tokens}")
    if cfg.trace and ref.logits is None:
        raise ValueError("tracing a replay needs a reference made with trace on (its logits)")
    device = ref.features.device
    clock = Stopwatch(device)
    first = ref.tokens[0]
    start = len(ref.context)  # position of the first new token
    proposer.start(ref.features[:start], torch.tensor(ref.context + [first], device=device))
    prefill_s = clock.lap()
    new, steps, stop, observe_s = [first], [], set(cfg.stop_token_ids), 0.0
    stopped = first in stop
    while not stopped and len(new) < cfg.max_new_tokens:
        proposed = proposer.propose()
        info = proposer.step_info()
        tree = _rooted_at(proposed, new[-1]).prune_depth(cfg.max_new_tokens - len(new) - 1)
        draft_s = observe_s + clock.lap()
        acc = verify_along(tree, ref.tokens[len(new):], past_end=ref.tokens[-1])  # past a stop token: cut below
        span = acc.accepted + 1  # the root and the accepted nodes
        at = start + len(new) - 1  # position of the root (the pending token)
        trace = clock.aside(path_trace, tree, acc, ref.logits[at - start:at - start + span]) if cfg.trace else None
        emitted = _cut(acc.new_tokens, stop, cfg.max_new_tokens - len(new))
        new += emitted
        stopped = emitted[-1] in stop
        steps.append(StepStats.of(tree, acc, len(emitted), draft_s, 0.0, clock.lap(), info, trace))
        observe_s = 0.0
        if not stopped and len(new) < cfg.max_new_tokens:
            proposer.observe(proposed, acc, ref.features[at:at + span])  # [A+1, F], as out.features[acc.nodes]
            observe_s = clock.lap()
    reason = "stop_token" if stopped else "max_new_tokens"
    return DecodeResult(tokens=new, steps=steps, prompt_tokens=len(ref.context), stop_reason=reason,
                        prefill_s=prefill_s, total_s=clock.elapsed(), trace_s=clock.aside_s)


class ReferenceCache:
    """References by context, shared by the variants replayed on a question (each replays to the
    reference's own tokens, so a conversation's later turns are the same for all of them); the
    `keep` most recent are kept. A reference is made again where a head attached since reads more
    target layers (its features would lack them) or a trace needs the logits it did not keep."""

    def __init__(self, keep: int = 4):  # a question's turns (MT-Bench: two), and some room
        self.keep = keep
        self._refs: OrderedDict[tuple, Reference] = OrderedDict()

    def get(self, target: Target, context: list[int], cfg: DecodeConfig) -> Reference:
        key = (tuple(context), cfg.max_new_tokens, tuple(cfg.stop_token_ids))
        ref = self._refs.get(key)
        if ref is None or ref.features.shape[-1] != target.feature_width or (cfg.trace and ref.logits is None):
            ref = greedy_reference(target, context, cfg)
        self._refs[key] = ref
        self._refs.move_to_end(key)
        while len(self._refs) > self.keep:
            self._refs.popitem(last=False)
        return ref


class ReplaySession(ChatSession):
    """A ChatSession whose turns are replayed against the target's own greedy reply: the same
    prompts, stop tokens and records (reused_prefix as the session's cache would have kept)."""

    def __init__(self, target: Target, proposer: Proposer, cfg: DecodeConfig, references: ReferenceCache,
                 system: str | None = None):
        super().__init__(target, proposer, cfg, system)
        self.references = references
        self._committed: list[int] = []  # what a ChatSession's cache would hold: context + reply but its last token

    def _decode(self, context_ids: list[int]) -> DecodeResult:
        ref = self.references.get(self.decoder.target, context_ids, self.cfg)
        result = replay(self.decoder.proposer, ref, self.cfg)
        result = replace(result, reused_prefix=min(_common_prefix(self._committed, context_ids), len(context_ids) - 1))
        self._committed = context_ids + result.tokens[:-1]
        return result
