"""Cost-aware EAGLE-2 trees (`--tree auto`): each step drafts as deep and verifies as many nodes
as maximise the expected tokens per second, from this machine's measured costs.

The paper's 60/5/10 trees were chosen for a GPU, where verifying 60 tokens costs about as much
as one; on a CPU a 64-token tree forward costs nearly twice a one-token forward (SmolLM2-135M,
bf16). So the tree's size is a trade, and the right trade changes every step: a confident head
should draft deep, an unsure one should stop early. Per step:

  expected tokens of a tree T  =  1 + sum_{v in T} a(c(v))
  time of a step               =  fixed + levels * level_ms(top_k) + verify_ms(|T| + 1)

where c(v) is the node's confidence (the product of the head's probabilities along its path,
which EAGLE-2 already uses as its acceptance estimate) and a() is a calibration of confidence to
the acceptance this head actually gets, learned online from every verified tree (binned on
log10 c, starting from a(c) = c). The costs come from `taps profile` (taps/drafter/profile.py), the
verify cost at the step's committed context: every tree node attends to all of it, so the same
tree costs more after 2,000 tokens than after 100, and a tree sized for a short prompt would be
too large for a long one.

After every level the policy compares the best rate of the nodes drafted so far with an
optimistic bound for one more level (the beams' own acceptance: their children cannot do
better); it stops when the bound loses. The kept nodes are always a prefix of the nodes sorted
by draft score, as in the fixed tree, so they form a tree; only their number is chosen.
Verification does not change, so any tree is lossless.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from taps.core.tree import DraftTree, keep_nodes, merge_trie, path_scores, rerank


def _interpolate(points: dict[int, float], x: float) -> float:
    """Piecewise-linear through the measured points; linear extrapolation past the last two."""
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    y0, y1 = points[x0], points[x1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class StepCosts:
    """Milliseconds per step part, as measured on this machine."""

    verify_ms: dict[int, float]  # tree tokens (root included) -> one target forward
    level_ms: dict[int, float]  # beams -> one draft level (head forward, LM head, top-k)
    fixed_ms: float = 0.0  # verification rule, commit, bookkeeping
    # committed context -> tree tokens -> one target forward (empty: verify_ms at every context)
    verify_by_context: dict[int, dict[int, float]] = field(default_factory=dict)

    CONTEXT_BUCKET = 64  # contexts are rounded to this, so nearby steps share one verify table

    def __post_init__(self) -> None:
        if not self.verify_ms or not self.level_ms:
            raise ValueError("StepCosts needs at least one measured tree size and one beam count")
        # more tokens never cost less: a noisy measurement that says so would make nodes look free
        for name in ("verify_ms", "level_ms"):
            points, running = getattr(self, name), 0.0
            monotone = {}
            for x in sorted(points):
                running = max(running, points[x])
                monotone[x] = running
            object.__setattr__(self, name, monotone)

    @classmethod
    def from_profile(cls, profile: dict, fixed_ms: float = 0.0) -> "StepCosts":
        if "draft_level_ms" not in profile:
            raise ValueError("the profile has no draft levels: profile with a drafter (taps profile --drafter DIR)")
        by_context = {int(c): {int(n): float(ms) for n, ms in t.items()}
                      for c, t in (profile.get("verify_ms_by_context") or {}).items()}
        return cls({int(n): float(ms) for n, ms in profile["target_forward_ms"].items()},
                   {int(k): float(ms) for k, ms in profile["draft_level_ms"].items()}, fixed_ms, by_context)

    def at(self, context: int) -> "StepCosts":
        """These costs with the verify cost measured at `context` committed tokens: each tree
        size interpolated between the measured contexts (linearly past the last two), the context
        rounded to CONTEXT_BUCKET tokens; one StepCosts per bucket, kept. Without a measurement
        by context, these costs themselves."""
        if not self.verify_by_context:
            return self
        bucket = max(0, round(context / self.CONTEXT_BUCKET) * self.CONTEXT_BUCKET)
        known = self.__dict__.setdefault("_at", {})
        if bucket not in known:
            sizes = set.intersection(*(set(t) for t in self.verify_by_context.values()))
            verify = {n: max(_interpolate({c: t[n] for c, t in self.verify_by_context.items()}, bucket), 1e-6)
                      for n in sizes}
            known[bucket] = StepCosts(verify, self.level_ms, self.fixed_ms)
        return known[bucket]

    def verify(self, tokens: int) -> float:
        return _interpolate(self.verify_ms, tokens)

    def verify_table(self, n: int) -> Tensor:  # -> [n] float64: verify(1), ..., verify(n)
        """The verify costs of 1..n tree tokens, computed once per size and reused: the policy reads
        them for every prefix of every level's candidates (hundreds per step)."""
        table = self.__dict__.get("_verify_table")
        if table is None or table.numel() < n:
            size = max(n, 2 * (table.numel() if table is not None else 64))
            table = torch.tensor([self.verify(t) for t in range(1, size + 1)], dtype=torch.float64)
            object.__setattr__(self, "_verify_table", table)
        return table[:n]

    def level(self, beams: int) -> float:
        return _interpolate(self.level_ms, beams)


class Calibration:
    """a(c) = P(a drafted node is accepted | its confidence c), one running estimate per bin of
    log10 c in [-4, 0]; each bin starts at its own midpoint confidence with `prior` pseudo-nodes."""

    def __init__(self, bins: int = 16, prior: float = 4.0):
        self.edges = torch.linspace(-4.0, 0.0, bins + 1)[1:-1]  # [bins - 1] inner edges
        mids = 10 ** torch.linspace(-4.0, 0.0, 2 * bins + 1)[1::2]  # [bins] midpoint confidences
        self.hits = (mids * prior).double()  # [bins]
        self.seen = torch.full((bins,), prior, dtype=torch.float64)  # [bins]

    def _bins(self, confidence: Tensor) -> Tensor:  # [N] -> [N] long
        return torch.bucketize(confidence.double().clamp(min=1e-12).log10().float(), self.edges)

    def __call__(self, confidence: Tensor) -> Tensor:  # [N] -> [N] float64
        b = self._bins(confidence.cpu())
        return self.hits[b] / self.seen[b]

    def update(self, confidence: Tensor, accepted: Tensor) -> None:
        """confidence [N] of verified draft nodes, accepted [N] bool: on the accepted path."""
        b = self._bins(confidence.cpu())
        self.seen.index_add_(0, b, torch.ones_like(b, dtype=torch.float64))
        self.hits.index_add_(0, b, accepted.cpu().double())


@dataclass
class AutoTree:
    """The per-step policy: `go_deeper` after each draft level, `tree_tokens` at the end."""

    costs: StepCosts
    top_k: int = 8
    calibration: Calibration = field(default_factory=Calibration)
    chosen: list[tuple[int, int]] = field(default_factory=list)  # (levels drafted, tree tokens) per step
    context: int = 0  # committed tokens at this step (its proposer sets it before drafting)

    @property
    def now(self) -> StepCosts:
        """The costs of a step at the current context."""
        return self.costs.at(self.context)

    def _best(self, scores: Tensor, levels: int, max_tokens: int | None = None) -> tuple[float, int, float]:
        """(best expected tokens per ms, its node count, its expected tokens) over prefixes of the
        nodes sorted by score, at most max_tokens - 1 nodes."""
        costs = self.now
        ordered = scores.sort(descending=True).values
        if max_tokens is not None:
            ordered = ordered[:max(max_tokens - 1, 0)]
        draft = costs.fixed_ms + levels * costs.level(self.top_k)
        if ordered.numel() == 0:
            return 1.0 / (draft + costs.verify(1)), 0, 1.0
        gain = self.calibration(ordered.exp())  # [N] expected acceptance, best first
        expected = 1.0 + torch.cat([torch.zeros(1, dtype=gain.dtype), gain.cumsum(0)])  # [N + 1] for 0..N nodes
        times = draft + costs.verify_table(expected.numel()).to(gain.dtype)  # [N + 1]: 1..N + 1 tree tokens
        rates = expected / times  # [N + 1]
        best = int(rates.argmax())
        return float(rates[best]), best, float(expected[best])

    def go_deeper(self, scores: Tensor, beam_scores: Tensor, levels: int) -> bool:
        """Whether one more level could beat the best tree of the `levels` drafted so far: its
        nodes add at most the beams' own expected acceptance, for one more level's cost."""
        costs = self.now
        rate, nodes, expected = self._best(scores, levels)
        bound = expected + float(self.calibration(beam_scores.exp()).sum())
        time = costs.fixed_ms + (levels + 1) * costs.level(self.top_k) + \
            costs.verify(nodes + 1 + beam_scores.numel())
        return bound / time > rate

    def tree_tokens(self, scores: Tensor, levels: int, max_tokens: int) -> int:
        """Tree size (root included) to verify: the best prefix of the nodes sorted by score."""
        _, nodes, _ = self._best(scores, levels, max_tokens)
        self.chosen.append((levels, nodes + 1))
        return nodes + 1

    def observe(self, confidence: Tensor, accepted: Tensor) -> None:
        self.calibration.update(confidence, accepted)


def merge_budget_by_cost(trees: Sequence[DraftTree], total_tokens: int, policy: AutoTree, sized: int) -> DraftTree:
    """The budget merge (the union of every member's tree as a trie) sized by cost instead of
    filled to `total_tokens`: every node a policy-sized member proposed is kept (bitmask `sized`:
    its own calibrated policy already chose those), and the other members' nodes, best score
    first, join only while they raise the expected tokens per millisecond.

    Those others are model-free drafters (prompt lookup, a datastore) whose score is already an
    acceptance estimate (prompt lookup's q^depth, a datastore's r x share: each source's own running
    estimate, times the datastore's frequency of the
    continuation), so node i adds exp(score_i) expected tokens for the verify cost of one more tree
    token, read from the same measured profile at the step's context (`policy.now`). Without the cut, a lookup member
    fills the tree up to the cap, and on a CPU every token past ~16 costs a tree forward more.
    The kept set is closed under parents (a node's path score never exceeds its parent's, and
    ties keep the earlier node), so verification is unchanged and stays lossless."""
    union = merge_trie(trees)
    if union.size <= 1:
        return union
    score, parents, drafters = path_scores(union), union.parents.tolist(), union.drafters.tolist()
    depth = [0] * union.size
    for i in range(1, union.size):  # parents precede children
        depth[i] = depth[parents[i]] + 1
    kept = [i for i in range(1, union.size) if drafters[i] & sized]
    if len(kept) + 1 >= total_tokens:
        return rerank(union, total_tokens)
    extra = sorted((i for i in range(1, union.size) if not drafters[i] & sized), key=lambda i: (-score[i], i))
    extra = extra[:total_tokens - 1 - len(kept)]
    levels = max((depth[i] for i in kept), default=0)
    costs = policy.now  # at the step's context, which the member's propose() set
    draft = costs.fixed_ms + levels * costs.level(policy.top_k)
    base = 1.0 + sum(math.exp(score[i]) for i in kept)
    gain = torch.tensor([math.exp(score[i]) for i in extra], dtype=torch.float64)  # [E], best first
    expected = base + torch.cat([torch.zeros(1, dtype=torch.float64), gain.cumsum(0)])  # [E + 1]: 0..E extra nodes
    times = draft + costs.verify_table(len(kept) + len(extra) + 1)[len(kept):]  # [E + 1]
    take = int((expected / times).argmax())
    keep = torch.tensor(sorted([0] + kept + extra[:take]), dtype=torch.long, device=union.parents.device)
    return keep_nodes(union, keep)
