"""The decode loop: speculative decoding with any Proposer; plain decoding is PlainProposer.

One step (numbered as in the code):
  1. draft     the proposer builds a tree rooted at the pending token
  2. trim      nodes deeper than the remaining token budget are dropped
  3. verify    one target forward over the tree, then the pure acceptance rule
  4. emit      accepted draft tokens + bonus, cut at the first stop token / the budget
  5. commit    the KV rows of exactly the kept path stay in the target's cache
  6. observe   the proposer consumes the accepted features (skipped once decoding ends)
A caller that wants tokens as they come (a server streaming a reply) or may stop early (a client
gone) passes `on_step` (an OnStep): it gets the emitted tokens and the step's record after the
prefill and after every step, and a true return value ends decoding there (stop_reason
"cancelled"), as gpt-fast's `callback` and transformers' `streamer` do without proposers knowing.
Plain decoding is the same loop with a root-only tree, so both use the same Target and cache
code and their timings compare like with like. Batch size 1. Timings come from one Stopwatch:
draft (this step's proposal and trim, plus the previous step's observe), target (the tree
forward), other (verification, emit, commit); tracing is set aside. The time of `on_step` is the
caller's but falls in the next lap (the next step's draft time), as the proposer's observe does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from taps.core.config import DecodeConfig
from taps.core.proposer import PlainProposer, Proposer, StepInfo
from taps.core.stopwatch import Stopwatch
from taps.core.target import Target
from taps.core.trace import StepTrace, step_trace
from taps.core.tree import DraftTree
from taps.core.verify import Acceptance, sample_token, verify


class ContextWindowError(ValueError):
    pass


@dataclass
class StepStats:
    accepted: int  # accepted draft tokens (bonus excluded) this verifier call
    emitted: int  # tokens this step added to the output (accepted + bonus, after stop/budget cuts)
    tree_size: int  # nodes verified, root included
    credited_drafter: int  # DraftTree.credited() of the deepest accepted node; -1 if no draft token was accepted
    draft_s: float  # proposing this tree + consuming the previous step's features
    target_s: float  # the target's tree forward
    other_s: float  # verification, commit, bookkeeping
    drafters: int = 0  # bitmask of every drafter that proposed the deepest accepted node (merged trees)
    info: StepInfo = field(default_factory=StepInfo)  # the proposer's own record of this step (e.g. routing scores)
    trace: StepTrace | None = None  # node confidences and entropies, when DecodeConfig.trace is set

    @classmethod
    def of(cls, tree: DraftTree, acc: Acceptance, emitted: int, draft_s: float, target_s: float, other_s: float,
           info: StepInfo, trace: StepTrace | None) -> "StepStats":
        """The record of one verified tree: provenance from the deepest accepted node's drafters."""
        deepest, drafted = int(acc.nodes[-1]), acc.accepted > 0
        return cls(accepted=acc.accepted, emitted=emitted, tree_size=tree.size,
                   credited_drafter=tree.credited(deepest) if drafted else -1, draft_s=draft_s, target_s=target_s,
                   other_s=other_s, drafters=int(tree.drafters[deepest]) if drafted else 0, info=info, trace=trace)


@dataclass
class DecodeResult:
    tokens: list[int]  # new tokens only
    steps: list[StepStats]  # one per tree verification (the prefill is not a step)
    prompt_tokens: int
    stop_reason: str  # "stop_token" | "max_new_tokens" | "cancelled" (on_step asked to stop)
    prefill_s: float
    total_s: float
    reused_prefix: int = 0  # prompt tokens whose KV rows were reused from the previous turn
    trace_s: float = 0.0  # time spent tracing (DecodeConfig.trace), excluded from total_s and the steps

    @property
    def verifier_calls(self) -> int:
        return len(self.steps) + 1  # the prefill's forward emits the first token

    @property
    def acceptance_length(self) -> float:
        """docs/spec.md §5: new tokens / verifier calls; plain decoding scores exactly 1.0."""
        return len(self.tokens) / self.verifier_calls

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.total_s if self.total_s > 0 else float("inf")

    def time_split(self) -> dict[str, float]:
        return {"prefill_s": self.prefill_s,
                "draft_s": sum(s.draft_s for s in self.steps),
                "target_s": sum(s.target_s for s in self.steps),
                "other_s": sum(s.other_s for s in self.steps)}


# the per-step hook of Decoder.run: (tokens emitted, that step's record; None for the prefill's
# first token) -> True to stop decoding after this step (None or False: go on)
OnStep = Callable[[list[int], "StepStats | None"], "bool | None"]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Decoder:
    """Decodes continuations of one growing sequence with one target and one proposer (None:
    plain decoding, a PlainProposer).

    Keeps the token ids whose KV rows are committed, and their target features, so a follow-up
    (the next chat turn) re-encodes only what differs from what the cache already holds.
    """

    target: Target
    proposer: Proposer | None = None
    committed: list[int] = field(default_factory=list)  # tokens with KV rows in the target cache
    _features: list[Tensor] = field(default_factory=list)  # chunks of [*, F] (Target.feature_width), aligned with `committed`

    def __post_init__(self) -> None:
        if self.proposer is None:
            self.proposer = PlainProposer()

    def check_window(self, context_len: int, cfg: DecodeConfig) -> None:
        window = self.target.context_window
        if context_len + cfg.max_new_tokens > window:
            raise ContextWindowError(
                f"the prompt has {context_len} tokens and max_new_tokens is {cfg.max_new_tokens}: "
                f"{context_len + cfg.max_new_tokens} exceeds the target's context window of {window} tokens "
                "(max_position_embeddings); shorten the prompt or lower --max-new-tokens")

    def run(self, context_ids: list[int], cfg: DecodeConfig, reuse_prefix: bool = False,
            on_step: OnStep | None = None) -> DecodeResult:
        """Decode a continuation of context_ids (`reuse_prefix`: keep the cache rows it shares with
        what this decoder committed before); `on_step`: see OnStep."""
        self._check_prompt(context_ids, cfg)
        gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
        clock = Stopwatch(self.target.device)
        pending, reused = self._prefill(context_ids, cfg, gen, reuse_prefix)  # 0. prefill
        prefill_s = clock.lap()
        new, steps, stop, observe_s = [pending], [], set(cfg.stop_token_ids), 0.0
        stopped = pending in stop
        cancelled = on_step is not None and bool(on_step([pending], None))
        while not stopped and not cancelled and len(new) < cfg.max_new_tokens:
            proposed = self.proposer.propose()  # 1. draft
            info = self.proposer.step_info()
            tree = _rooted_at(proposed, pending).prune_depth(cfg.max_new_tokens - len(new) - 1)  # 2. trim
            draft_s = observe_s + clock.lap()
            out = self.target.forward_tree(tree)  # 3. verify
            target_s = clock.lap()
            acc = verify(tree, out.logits, cfg.sampling, gen)
            trace = clock.aside(step_trace, tree, acc, out.logits) if cfg.trace else None
            emitted = _cut(acc.new_tokens, stop, cfg.max_new_tokens - len(new))  # 4. emit
            self._commit(acc.nodes[:len(emitted)], acc.tokens[:len(emitted)], out.features)  # 5. commit
            new += emitted
            pending, stopped = emitted[-1], emitted[-1] in stop
            steps.append(StepStats.of(tree, acc, len(emitted), draft_s, target_s, clock.lap(), info, trace))
            cancelled = on_step is not None and bool(on_step(emitted, steps[-1]))
            observe_s = 0.0
            if not stopped and not cancelled and len(new) < cfg.max_new_tokens:  # 6. observe, if decoding goes on
                self.proposer.observe(proposed, acc, out.features[acc.nodes])
                observe_s = clock.lap()
        reason = "stop_token" if stopped else "max_new_tokens" if len(new) >= cfg.max_new_tokens else "cancelled"
        return DecodeResult(tokens=new, steps=steps, prompt_tokens=len(context_ids), stop_reason=reason,
                            prefill_s=prefill_s, total_s=clock.elapsed(), reused_prefix=reused,
                            trace_s=clock.aside_s)

    def _check_prompt(self, context_ids: list[int], cfg: DecodeConfig) -> None:
        if not context_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        self.check_window(len(context_ids), cfg)
        vocab = self.target.vocab_size
        bad = next((i for i, tok in enumerate(context_ids) if not 0 <= tok < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {context_ids[bad]} at index {bad} is outside the target's "
                             f"vocabulary of {vocab}")

    def _prefill(self, context_ids: list[int], cfg: DecodeConfig, gen: torch.Generator,
                 reuse_prefix: bool) -> tuple[int, int]:
        """Prefill whatever the cache does not already hold, sample the first new token (the pending
        one) and start the proposer; returns it and the number of prompt tokens reused."""
        keep = min(_common_prefix(self.committed, context_ids), len(context_ids) - 1) if reuse_prefix else 0
        if keep and self._features and self._features[0].shape[-1] != self.target.feature_width:
            keep = 0  # a head attached since then reads target layers the kept features lack
        if keep:
            self.target.truncate(keep)
        else:
            self.target.reset()
        out = self.target.prefill(torch.tensor(context_ids[keep:], dtype=torch.long))
        first = sample_token(out.logits[-1], cfg.sampling, gen)
        self.committed = list(context_ids)
        self._features = self._features_prefix(keep) + [out.features]
        self.proposer.start(torch.cat(self._features), torch.tensor(context_ids + [first], device=self.target.device))
        return first, keep

    def _commit(self, nodes: Tensor, tokens: Tensor, features: Tensor) -> None:
        """Keep the KV rows and features of exactly the accepted nodes (root first), in order;
        the last emitted token stays pending."""
        self.target.commit(nodes)
        self.committed += tokens.tolist()
        self._features.append(features[nodes])

    def _features_prefix(self, n: int) -> list[Tensor]:
        if n == 0 or not self._features:
            return []
        return [torch.cat(self._features)[:n]]


def _rooted_at(tree: DraftTree, pending: int) -> DraftTree:
    if int(tree.tokens[0]) != pending:
        raise RuntimeError(f"proposer returned a tree rooted at {int(tree.tokens[0])}, "
                           f"expected pending token {pending}")
    return tree


def _cut(emitted: list[int], stop: set[int], room: int) -> list[int]:
    """The emitted tokens up to and including the first stop token, at most `room` of them."""
    m = next((i + 1 for i, tok in enumerate(emitted) if tok in stop), len(emitted))
    return emitted[:min(m, room)]


def generate(target: Target, proposer: Proposer | None, prompt_ids: list[int], cfg: DecodeConfig,
             on_step: OnStep | None = None) -> DecodeResult:
    """Decode a continuation of prompt_ids from an empty cache. proposer=None: plain decoding;
    `on_step`: the per-step hook (OnStep)."""
    return Decoder(target, proposer).run(list(prompt_ids), cfg, on_step=on_step)


# ---- chat --------------------------------------------------------------------------------------
def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation rendered by the tokenizer's chat template, ready for the
    assistant's next turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the target tokenizer has no chat template; pass --raw to decode the prompt as plain text")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def reply_text(tokenizer, tokens: list[int], stop_token_ids) -> str:
    """A reply as a user reads it: the new tokens decoded with the stop tokens and the tokenizer's
    special tokens left out (`taps generate`, chat turns, the server, regeneration)."""
    stop = set(stop_token_ids)
    return tokenizer.decode([t for t in tokens if t not in stop], skip_special_tokens=True)


class ChatSession:
    """A multi-turn conversation: each user turn continues the previous one, reusing the cache
    for every token the new rendering shares with what was already decoded."""

    def __init__(self, target: Target, proposer: Proposer | None, cfg: DecodeConfig, system: str | None = None):
        if target.tokenizer is None:
            raise ValueError("chat needs the target's tokenizer")
        self.decoder = Decoder(target, proposer)
        # without explicit stop tokens a turn ends at the target's EOS / end-of-turn tokens
        self.cfg = cfg if cfg.stop_token_ids else replace(cfg, stop_token_ids=target.stop_token_ids())
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []

    def send(self, user_text: str) -> tuple[str, DecodeResult]:
        tok = self.decoder.target.tokenizer
        self.messages.append({"role": "user", "content": user_text})
        result = self._decode(chat_ids(tok, self.messages))
        reply = reply_text(tok, result.tokens, self.cfg.stop_token_ids)
        self.messages.append({"role": "assistant", "content": reply})
        return reply, result

    def _decode(self, context_ids: list[int]) -> DecodeResult:
        """One turn's continuation of the whole conversation (core/replay.ReplaySession replays it)."""
        return self.decoder.run(context_ids, self.cfg, reuse_prefix=True)
