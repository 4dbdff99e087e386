"""The decode loop: speculative decoding with any Proposer, and plain decoding with none.

One step (numbered as in the code):
  1. draft     the proposer builds a tree rooted at the pending token
  2. trim      nodes deeper than the remaining token budget are dropped
  3. verify    one target forward over the tree, then the pure acceptance rule
  4. emit      accepted draft tokens + bonus, cut at the first stop token / the budget
  5. commit    the KV rows of exactly the kept path stay in the target's cache
  6. observe   the proposer consumes the accepted features (skipped once decoding ends)
Plain decoding is the same loop with a root-only tree, so both use the same Target and cache
code and their timings compare like with like. Batch size 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from taps.config import DecodeConfig
from taps.propose.base import Proposer
from taps.target import Target
from taps.trace import StepTrace, step_trace
from taps.tree import DraftTree
from taps.verify import sample_token, verify


class ContextWindowError(ValueError):
    pass


@dataclass
class StepStats:
    accepted: int  # accepted draft tokens (bonus excluded) this verifier call
    emitted: int  # tokens this step added to the output (accepted + bonus, after stop/budget cuts)
    tree_size: int  # nodes verified, root included
    source: int  # drafter of the deepest accepted node; -1 if no draft token was accepted
    draft_s: float  # proposing this tree + consuming the previous step's features
    target_s: float  # the target's tree forward
    other_s: float  # verification, commit, bookkeeping
    sources: int = 0  # bitmask of every drafter that proposed the deepest accepted node (merged trees)
    info: dict = field(default_factory=dict)  # the proposer's own record of this step (e.g. routing scores)
    trace: StepTrace | None = None  # node confidences and entropies, when DecodeConfig.trace is set


@dataclass
class DecodeResult:
    tokens: list[int]  # new tokens only
    steps: list[StepStats]  # one per tree verification (the prefill is not a step)
    prompt_tokens: int
    stop_reason: str  # "stop_token" | "max_new_tokens"
    prefill_s: float
    total_s: float
    reused_prefix: int = 0  # prompt tokens whose KV rows were reused from the previous turn
    trace_s: float = 0.0  # time spent tracing (DecodeConfig.trace), excluded from total_s and the steps

    @property
    def verifier_calls(self) -> int:
        return len(self.steps) + 1  # the prefill's forward emits the first token

    @property
    def acceptance_length(self) -> float:
        """SPEC §5: new tokens / verifier calls; plain decoding scores exactly 1.0."""
        return len(self.tokens) / self.verifier_calls

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.total_s if self.total_s > 0 else float("inf")

    def time_split(self) -> dict[str, float]:
        return {"prefill_s": self.prefill_s,
                "draft_s": sum(s.draft_s for s in self.steps),
                "target_s": sum(s.target_s for s in self.steps),
                "other_s": sum(s.other_s for s in self.steps)}


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Decoder:
    """Decodes continuations of one growing sequence with one target (and optionally a proposer).

    Keeps the token ids whose KV rows are committed, and their target features, so a follow-up
    (the next chat turn) re-encodes only what differs from what the cache already holds.
    """

    target: Target
    proposer: Proposer | None = None
    committed: list[int] = field(default_factory=list)  # tokens with KV rows in the target cache
    _features: list[Tensor] = field(default_factory=list)  # chunks of [*, H], aligned with `committed`

    def check_window(self, context_len: int, cfg: DecodeConfig) -> None:
        window = self.target.context_window
        if context_len + cfg.max_new_tokens > window:
            raise ContextWindowError(
                f"the prompt has {context_len} tokens and max_new_tokens is {cfg.max_new_tokens}: "
                f"{context_len + cfg.max_new_tokens} exceeds the target's context window of {window} tokens "
                "(max_position_embeddings); shorten the prompt or lower --max-new-tokens")

    def run(self, context_ids: list[int], cfg: DecodeConfig, reuse_prefix: bool = False) -> DecodeResult:
        if not context_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        self.check_window(len(context_ids), cfg)
        vocab = self.target.vocab_size
        bad = next((i for i, tok in enumerate(context_ids) if not 0 <= tok < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {context_ids[bad]} at index {bad} is outside the target's "
                             f"vocabulary of {vocab}")
        target, device = self.target, self.target.device
        gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
        t0 = _clock(device)

        # 0. prefill whatever the cache does not already hold, sample the first new token
        keep = min(_common_prefix(self.committed, context_ids), len(context_ids) - 1) if reuse_prefix else 0
        if keep:
            target.truncate(keep)
        else:
            target.reset()
        out = target.prefill(torch.tensor(context_ids[keep:], dtype=torch.long))
        first = sample_token(out.logits[-1], cfg.sampling, gen)
        self.committed = list(context_ids)
        if self.proposer is not None:  # features are kept only for a proposer to restart from
            self._features = self._features_prefix(keep) + [out.features]
            self.proposer.start(torch.cat(self._features), torch.tensor(context_ids + [first], device=device))
        t1 = _clock(device)

        new, steps, pending = [first], [], first
        stop = set(cfg.stop_token_ids)
        stop_reason = "stop_token" if first in stop else "max_new_tokens"
        observe_s, trace_s = 0.0, 0.0
        while stop_reason != "stop_token" and len(new) < cfg.max_new_tokens:
            # 1-2. draft a tree and trim it to the remaining budget
            a = _clock(device)
            tree = self.proposer.propose() if self.proposer is not None else DraftTree.root_only(pending, device)
            info = self.proposer.step_info() if hasattr(self.proposer, "step_info") else {}
            if int(tree.tokens[0]) != pending:
                raise RuntimeError(f"proposer returned a tree rooted at {int(tree.tokens[0])}, expected pending token {pending}")
            tree = tree.prune_depth(cfg.max_new_tokens - len(new) - 1)
            b = _clock(device)
            # 3. verify
            out = target.forward_tree(tree)
            c = _clock(device)
            acc = verify(tree, out.logits, cfg.sampling, gen)
            trace = None
            if cfg.trace:  # read-only; its time is taken out of this step's clock below
                t = _clock(device)
                trace = step_trace(tree, acc, out.logits)
                traced = _clock(device) - t
                trace_s += traced
                c += traced
            # 4. emit, cut at the first stop token
            emitted = acc.new_tokens
            m = next((i + 1 for i, tok in enumerate(emitted) if tok in stop), len(emitted))
            m = min(m, cfg.max_new_tokens - len(new))
            if emitted[m - 1] in stop:
                stop_reason = "stop_token"
            # 5. commit the kept path: root + the first m-1 accepted nodes; the m-th token is pending
            kept = acc.nodes[:m]
            target.commit(kept)
            self.committed += acc.tokens[:m].tolist()
            if self.proposer is not None:
                self._features.append(out.features[kept])
            new += emitted[:m]
            pending = emitted[m - 1]
            deepest = int(acc.nodes[-1])
            source = int(tree.source[deepest]) if acc.accepted > 0 else -1
            sources = int(tree.source_mask()[deepest]) if acc.accepted > 0 else 0
            d = _clock(device)
            steps.append(StepStats(accepted=acc.accepted, emitted=m, tree_size=tree.size, source=source,
                                   draft_s=observe_s + (b - a), target_s=c - b, other_s=d - c, sources=sources,
                                   info=info, trace=trace))
            # 6. feed the accepted features back (only if decoding goes on)
            observe_s = 0.0
            if self.proposer is not None and stop_reason != "stop_token" and len(new) < cfg.max_new_tokens:
                e = _clock(device)
                self.proposer.observe(acc, out.features[acc.nodes])
                observe_s = _clock(device) - e
        t2 = _clock(device)
        return DecodeResult(tokens=new, steps=steps, prompt_tokens=len(context_ids), stop_reason=stop_reason,
                            prefill_s=t1 - t0, total_s=t2 - t0 - trace_s, reused_prefix=keep, trace_s=trace_s)

    def _features_prefix(self, n: int) -> list[Tensor]:
        if n == 0 or not self._features:
            return []
        return [torch.cat(self._features)[:n]]


def generate(target: Target, proposer: Proposer | None, prompt_ids: list[int], cfg: DecodeConfig) -> DecodeResult:
    """Decode a continuation of prompt_ids from an empty cache. proposer=None: plain decoding."""
    return Decoder(target, proposer).run(list(prompt_ids), cfg)


# ---- chat --------------------------------------------------------------------------------------
def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation rendered by the tokenizer's chat template, ready for the
    assistant's next turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the target tokenizer has no chat template; pass --raw to decode the prompt as plain text")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


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
        result = self.decoder.run(chat_ids(tok, self.messages), self.cfg, reuse_prefix=True)
        stop = set(self.cfg.stop_token_ids)
        reply = tok.decode([t for t in result.tokens if t not in stop], skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": reply})
        return reply, result
