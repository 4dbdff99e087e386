"""Lossless verification of a draft tree: pure functions, no model, no cache, no mutation.

Glossary
--------
root       node 0 of the tree: the last committed token. Its target logits predict the first
           draft level.
accepted   draft nodes on the path the target agrees with, root excluded. A step emits
           len(accepted) + 1 tokens.
bonus      the token the target itself produces after the last accepted node: its argmax
           (greedy), or a sample from the residual distribution left after the rejections at
           that node (sampling). It is always emitted, so every step makes progress.
residual   the target distribution at a node with every rejected candidate token set to zero
           and the rest renormalised.

Both rules walk the tree from the root. Nodes that carry the same token sequence from the root
(for example the same proposal from two drafters in a merged tree) are walked as one state and
their children pooled: the target distribution at such nodes is the same, because their
contexts are identical, so each distinct token is tried once. This is what makes routed and
merged trees exactly as lossless as a single tree (docs/spec.md §3, the paper's appendix A.4).

Sampling is the recursive rejection scheme for deterministic draft candidates: at the current
state with target distribution p, each distinct child token x is tried in order of draft score
and accepted with probability p(x); on rejection p(x) := 0 and p is renormalised. If a child is
accepted the walk descends; otherwise the bonus is sampled from the residual p. The emitted
token at every position is then distributed exactly as p, whatever the draft is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from taps.core.config import SamplingConfig
from taps.core.tree import DraftTree, TokenPaths


@dataclass(frozen=True)
class Acceptance:
    nodes: Tensor  # [A+1] long, accepted tree nodes, root first
    tokens: Tensor  # [A+1] long, their tokens (tokens[0] = root token)
    bonus: int  # token emitted after the last accepted node

    @property
    def accepted(self) -> int:
        """Number of accepted draft tokens (root excluded)."""
        return int(self.nodes.shape[0]) - 1

    @property
    def new_tokens(self) -> list[int]:
        """Tokens this step emits: accepted draft tokens then the bonus."""
        return self.tokens[1:].tolist() + [self.bonus]


def target_probs(logits: Tensor, sampling: SamplingConfig) -> Tensor:
    """Target next-token distribution for one position: [V] logits -> [V] float64 probabilities on CPU.

    Temperature first, then top-k, then top-p (nucleus: the smallest set of most likely tokens
    whose mass reaches top_p), then renormalisation.
    """
    if sampling.greedy:
        raise ValueError("target_probs needs temperature > 0; greedy verification uses argmax")
    scaled = logits.detach().to("cpu", torch.float64) / sampling.temperature  # [V]
    if sampling.top_k and sampling.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, sampling.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if sampling.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = mass_before >= sampling.top_p  # never drops the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum()
    return probs


def sample_token(logits: Tensor, sampling: SamplingConfig, gen: torch.Generator) -> int:
    """One token from the target's distribution at one position (argmax when greedy)."""
    if sampling.greedy:
        return int(logits.argmax(-1))
    return int(torch.multinomial(target_probs(logits, sampling), 1, generator=gen))


# A chooser decides one step of the walk: given the representative node and the distinct
# candidate tokens (best draft score first), return (accepted token or None, bonus token or None).
_Chooser = Callable[[int, list[int]], tuple[int | None, int | None]]


def _walk(tree: DraftTree, choose: _Chooser) -> Acceptance:
    paths = TokenPaths(tree)
    state = [0]  # nodes sharing one token path from the root; state[0] is the representative
    while True:
        by_token = paths.options(state)  # the distinct next tokens, best draft score first
        accepted, bonus = choose(state[0], list(by_token))
        if accepted is None:
            break
        state = by_token[accepted]  # lowest node id first: ties go to the first tree
    last = state[0]
    nodes = torch.tensor(tree.path_to(last), dtype=torch.long, device=tree.tokens.device)
    return Acceptance(nodes=nodes, tokens=tree.tokens[nodes], bonus=int(bonus))


def verify_greedy(tree: DraftTree, logits: Tensor) -> Acceptance:
    """Greedy (T=0) acceptance: follow the target's argmax through the tree; logits [N, V]."""
    argmax = logits.argmax(dim=-1).tolist()  # [N]

    def choose(node: int, candidates: list[int]) -> tuple[int | None, int | None]:
        best = argmax[node]
        return (best, None) if best in candidates else (None, best)

    return _walk(tree, choose)


def verify_along(tree: DraftTree, continuation: list[int], past_end: int) -> Acceptance:
    """Greedy acceptance when the target's argmax along the accepted path is known in advance:
    `continuation[d]` is the target's greedy token after the path's first d + 1 tokens (replay,
    core/replay.py). Walks the tree as verify_greedy does, duplicate token paths of merged trees
    included; `past_end` is the bonus where the continuation runs out (a caller that cuts there)."""
    depth = 0  # of the node being walked: continuation[depth] is the target's token after it

    def choose(node: int, candidates: list[int]) -> tuple[int | None, int | None]:
        nonlocal depth
        if depth >= len(continuation):
            return None, past_end
        best = continuation[depth]
        if best in candidates:
            depth += 1
            return best, None
        return None, best

    return _walk(tree, choose)


def verify_sampling(
    tree: DraftTree, logits: Tensor, sampling: SamplingConfig, gen: torch.Generator
) -> Acceptance:
    """Sampling (T > 0) acceptance by recursive rejection; logits [N, V]; `gen` is a CPU generator.
    T = 0 is verify_greedy's (verify() dispatches; target_probs refuses T = 0)."""

    def choose(node: int, candidates: list[int]) -> tuple[int | None, int | None]:
        p = target_probs(logits[node], sampling)  # [V] float64
        for token in candidates:
            if float(torch.rand((), generator=gen, dtype=torch.float64)) < float(p[token]):
                return token, None
            p[token] = 0.0
            total = p.sum()
            if not total > 0:
                raise RuntimeError("residual distribution vanished during verification (numerical error)")
            p = p / total
        return None, int(torch.multinomial(p, 1, generator=gen))

    return _walk(tree, choose)


def verify(
    tree: DraftTree, logits: Tensor, sampling: SamplingConfig, gen: torch.Generator
) -> Acceptance:
    """Dispatch on temperature: greedy when sampling.temperature == 0, else recursive rejection."""
    if sampling.greedy:
        return verify_greedy(tree, logits)
    return verify_sampling(tree, logits, sampling, gen)
