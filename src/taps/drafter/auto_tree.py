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

from taps.core.tree import DraftTree, TokenPaths, keep_nodes, merge_trie, path_scores, rerank


def _interpolate(points: dict[int, float], x: float) -> float:
    """Piecewise-linear through the measured points; linear extrapolation past the last two."""
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    y0, y1 = points[x0], points[x1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _denoised(points: dict[int, float], real_dip: float) -> dict[int, float]:
    """`points` with every cost below the most a smaller size cost raised to it, unless it is at
    least `real_dip` (a fraction) below it: 1 makes the costs monotone. The best prefix of a tree's
    nodes (best_prefix) is the argmax of expected tokens over time, which reads a real dip as the
    larger tree it is (more nodes for less time), while a noisy one would only move it by noise."""
    kept, most = {}, 0.0
    for x in sorted(points):
        y = points[x]
        kept[x] = y if y < most * (1.0 - real_dip) else max(y, most)
        most = max(most, y)
    return kept


@dataclass(frozen=True)
class StepCosts:
    """Milliseconds per step part, as measured on this machine."""

    verify_ms: dict[int, float]  # tree tokens (root included) -> one target forward
    level_ms: dict[int, float]  # beams -> one draft level (head forward, LM head, top-k)
    fixed_ms: float = 0.0  # verification rule, commit, bookkeeping
    # committed context -> tree tokens -> one target forward (empty: verify_ms at every context)
    verify_by_context: dict[int, dict[int, float]] = field(default_factory=dict)

    CONTEXT_BUCKET = 64  # contexts are rounded to this, so nearby steps share one verify table
    # a tree size measured at least this much below a smaller one's cost runs faster (a CPU's matmul
    # kernels favour some row counts); a smaller dip is noise, and raised to the smaller size's cost
    REAL_DIP = 0.05

    def __post_init__(self) -> None:
        if not self.verify_ms or not self.level_ms:
            raise ValueError("StepCosts needs at least one measured tree size and one beam count")
        object.__setattr__(self, "verify_ms", _denoised(self.verify_ms, self.REAL_DIP))
        # more beams never cost less: a noisy measurement that says so would make levels look free
        object.__setattr__(self, "level_ms", _denoised(self.level_ms, 1.0))

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

    def __init__(self, bins: int = 16, prior: float = 4.0, remembered=None):
        """`remembered`: what a server's earlier requests taught this estimate (a
        propose/memory.CalibrationMemory with as many bins): it starts warm from it, and every
        update is remembered there too."""
        self.edges = torch.linspace(-4.0, 0.0, bins + 1)[1:-1]  # [bins - 1] inner edges
        mids = 10 ** torch.linspace(-4.0, 0.0, 2 * bins + 1)[1::2]  # [bins] midpoint confidences
        self.hits = (mids * prior).double()  # [bins]
        self.seen = torch.full((bins,), prior, dtype=torch.float64)  # [bins]
        self.remembered = remembered
        if remembered is not None:
            self.hits, self.seen = remembered.warm(self.hits, self.seen)

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
        if self.remembered is not None:
            self.remembered.add(b, accepted.cpu())


def best_prefix(base: float, gain: Tensor, times: Tensor) -> tuple[int, float, float]:
    """The best prefix of nodes sorted best first: (its node count, its expected tokens, their rate
    per ms), from `base` expected tokens without any, each node's `gain` [E] and the step's time
    with 0..E of them `times` [E + 1]."""
    expected = base + torch.cat([torch.zeros(1, dtype=gain.dtype), gain.cumsum(0)])  # [E + 1]
    rates = expected / times  # [E + 1]
    best = int(rates.argmax())
    return best, float(expected[best]), float(rates[best])


@dataclass
class AutoTree:
    """The per-step policy: `go_deeper` after each draft level, `tree_tokens` at the end."""

    costs: StepCosts
    top_k: int = 8
    calibration: Calibration = field(default_factory=Calibration)
    chosen: list[tuple[int, int]] = field(default_factory=list)  # (levels drafted, tree tokens) per step
    # a(c) of this head's nodes that no other member of a budget merge proposed (merge_budget_by_cost)
    alone: Calibration = field(default_factory=Calibration)
    context: int = 0  # committed tokens at this step (its proposer sets it before drafting)
    # (expected tokens, nodes) the model-free members of a budget merge already offer this step
    # (brief_sized_members): a head's node pays only if it raises the rate of the whole merged tree
    given: tuple[float, int] = (0.0, 0)

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
        given_tokens, given_nodes = self.given
        if ordered.numel() == 0:
            return (1.0 + given_tokens) / (draft + costs.verify(1 + given_nodes)), 0, 1.0 + given_tokens
        gain = self.calibration(ordered.exp())  # [N] expected acceptance, best first
        # [N + 1]: 1 + given + 0..N tree tokens, over what the other members offer
        times = draft + costs.verify_table(given_nodes + gain.numel() + 1)[given_nodes:].to(gain.dtype)
        best, expected, rate = best_prefix(1.0 + given_tokens, gain, times)
        return rate, best, expected

    def go_deeper(self, scores: Tensor, beam_scores: Tensor, levels: int) -> bool:
        """Whether one more level could beat the best tree of the `levels` drafted so far: its
        nodes add at most the beams' own expected acceptance, for one more level's cost."""
        costs = self.now
        rate, nodes, expected = self._best(scores, levels)
        bound = expected + float(self.calibration(beam_scores.exp()).sum())
        time = costs.fixed_ms + (levels + 1) * costs.level(self.top_k) + \
            costs.verify(nodes + 1 + self.given[1] + beam_scores.numel())
        return bound / time > rate

    def tree_tokens(self, scores: Tensor, levels: int, max_tokens: int) -> int:
        """Tree size (root included) to verify: the best prefix of the nodes sorted by score."""
        _, nodes, _ = self._best(scores, levels, max_tokens)
        self.chosen.append((levels, nodes + 1))
        return nodes + 1

    def observe(self, confidence: Tensor, accepted: Tensor) -> None:
        self.calibration.update(confidence, accepted)

    def remember(self, memory) -> "AutoTree":
        """This policy with both calibrations warm from `memory` (a propose/memory.HeadMemory:
        what a server's earlier requests taught them), and teaching it in turn; before any step."""
        self.calibration = Calibration(remembered=memory.calibration)
        self.alone = Calibration(remembered=memory.alone)
        return self


def merge_budget_by_cost(trees: Sequence[DraftTree], total_tokens: int, policy: AutoTree, sized: int) -> DraftTree:
    """The budget merge (the union of every member's tree as a trie) sized by cost instead of
    filled to `total_tokens`: the nodes a policy-sized member (a head, bitmask `sized`) and a
    model-free member (prompt lookup, a datastore) both proposed are kept, and every other node,
    best expected acceptance first, joins only while it raises the expected tokens per millisecond.

    The model-free members' score is already an acceptance estimate (prompt lookup's rates along
    the path, a datastore's r x share: each source's own running estimates, times the datastore's
    frequency of the continuation), so such a node adds exp(score) expected tokens. A node only the heads
    proposed adds `policy.alone(confidence)`: the acceptance of such nodes measured in earlier
    merges (observe_budget_merge), not the head's own calibration, which pools them with the
    nodes lookup proposed too and so overstates them where lookup drafts well (a served format,
    an online datastore). Each extra node costs the verify cost of one more tree token, read from
    the measured profile at the step's context (`policy.now`). Without the cut a lookup member
    fills the tree up to the cap, and on a CPU every token past ~16 costs a tree forward more.
    A node's estimate is capped at its parent's, ties keep the earlier node, and a shared node's
    parent is shared, so the kept set is closed under parents: verification is unchanged and
    stays lossless."""
    union = merge_trie(trees)
    if union.size <= 1:
        return union
    score, parents, drafters = path_scores(union), union.parents.tolist(), union.drafters.tolist()
    depth = [0] * union.size
    for i in range(1, union.size):  # parents precede children
        depth[i] = depth[parents[i]] + 1
    kept = [i for i in range(1, union.size) if drafters[i] & sized and drafters[i] & ~sized]
    if len(kept) + 1 >= total_tokens:
        return rerank(union, total_tokens)
    alone = [i for i in range(1, union.size) if not drafters[i] & ~sized]
    calibrated = policy.alone(torch.tensor([math.exp(score[i]) for i in alone], dtype=torch.float64)).tolist()
    estimate = [math.exp(s) for s in score]  # [size] expected acceptance of each node
    for i, a in zip(alone, calibrated):
        estimate[i] = a
    is_kept = set(kept)
    for i in range(1, union.size):  # a node never promises more than its parent (parents precede children)
        if i not in is_kept and parents[i] > 0:
            estimate[i] = min(estimate[i], estimate[parents[i]])
    extra = sorted((i for i in range(1, union.size) if i not in is_kept), key=lambda i: (-estimate[i], i))
    extra = extra[:total_tokens - 1 - len(kept)]
    levels = max((depth[i] for i in range(1, union.size) if drafters[i] & sized), default=0)
    costs = policy.now  # at the step's context, which the member's propose() set
    draft = costs.fixed_ms + levels * costs.level(policy.top_k)
    gain = torch.tensor([estimate[i] for i in extra], dtype=torch.float64)  # [E], best first
    times = draft + costs.verify_table(len(kept) + len(extra) + 1)[len(kept):]  # [E + 1]: 0..E extra nodes
    take, _, _ = best_prefix(1.0 + sum(estimate[i] for i in kept), gain, times)
    keep = torch.tensor(sorted([0] + kept + extra[:take]), dtype=torch.long, device=union.parents.device)
    return keep_nodes(union, keep)


def size_by_cost(tree: DraftTree, policy: AutoTree) -> DraftTree:
    """A model-free drafter's tree (prompt lookup, a datastore) verified alone under `--tree auto`:
    its best-scored nodes, as many as maximise the expected tokens per millisecond at the step's
    context (`policy.now`). Such a tree's scores are already acceptance estimates (prompt lookup's
    product of its path's learned rates over its rank, a datastore's r x share: propose/lookup.py),
    so a node adds exp(score) expected tokens, as in merge_budget_by_cost. Without the cut a lookup
    tree is filled to its budget, and on a long prompt on a CPU each node past a short chain costs
    a tree forward more than it returns. The kept nodes are a prefix of the rank order (rerank),
    closed under parents: lossless."""
    if tree.size <= 1:  # nothing matched: a plain step
        policy.chosen.append((0, 1))
        return tree
    take, _ = _paying_nodes(tree, policy.now)
    policy.chosen.append((0, take + 1))
    return rerank(tree, take + 1)


def _paying_nodes(tree: DraftTree, costs: StepCosts) -> tuple[int, float]:
    """(nodes, expected tokens) of the best-paying share of a model-free tree verified alone: its
    nodes best estimate first (path scores, so the share is closed under parents), as many as
    maximise expected tokens per millisecond of verification."""
    gain = torch.tensor(sorted((math.exp(s) for s in path_scores(tree)[1:]), reverse=True),
                        dtype=torch.float64)  # [E] best first
    take, expected, _ = best_prefix(1.0, gain, costs.fixed_ms + costs.verify_table(gain.numel() + 1))
    return take, expected


def brief_sized_members(trees: Sequence[DraftTree], context: int | None = None, *,
                        policies: Sequence[AutoTree]) -> None:
    """Tell the heads' policies of a budget merge what its model-free members (prompt lookup, a
    datastore), which draft first, already offer this step: the expected tokens and node count of
    their best-paying share alone (their nodes best estimate first, as many as maximise expected
    tokens per millisecond of verification). A head then drafts another level, and keeps another
    node, only where that raises the rate of the merged tree: where lookup already drafts a served
    format well, the head stops early, and its levels (a head forward each) are not spent on nodes
    the merge would not keep. `context`: the committed context of this step (the policies price
    its verify cost; a head that did not draft last step would otherwise price the one before)."""
    if context is not None:
        for policy in policies:
            policy.context = context
    union = merge_trie(trees) if trees else None
    given = (0.0, 0)
    if union is not None and union.size > 1 and policies:
        take, expected = _paying_nodes(union, policies[0].now)
        given = (expected - 1.0, take)
    for policy in policies:
        policy.given = given


def observe_budget_merge(parts: Sequence[DraftTree], tokens: Sequence[int], policy: AutoTree, sized: int) -> None:
    """Teach `policy.alone` what a node only the heads proposed is worth in a budget merge: over
    the union of the members' own trees (`parts`, before the cut: a node the cut left out whose
    token the target emitted counts as accepted, as a head's own calibration counts it), each
    such node's confidence and whether it lies on the path of `tokens` (the accepted draft tokens
    and the bonus)."""
    union = merge_trie(parts)
    if union.size <= 1:
        return
    on = torch.zeros(union.size, dtype=torch.bool)  # [N]
    for state in TokenPaths(union).follow(tokens):
        on[state] = True
    drafters = union.drafters.tolist()
    alone = torch.tensor([i for i in range(1, union.size) if not drafters[i] & ~sized], dtype=torch.long)
    if alone.numel():
        policy.alone.update(union.confidence[alone], on[alone])
