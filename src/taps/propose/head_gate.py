"""HeadGate: whether the heads of a budget merge with prompt lookup draft at all this step.

Under `--tree auto` the model-free members of a budget merge (prompt lookup, a datastore) draft
first, and the heads size their trees over what those already offer (drafter/auto_tree.py
brief_sized_members). But a head pays before it can size anything: it consumes the accepted
tokens, runs its LM head over the root and drafts a first level. Where lookup copies (a summary
quoting its document, a served JSON format the online datastore holds) those milliseconds buy
almost nothing: on session 36's long summarisation prompts the head drafted 7.6 ms a step for
0.4 more tokens a call, and the merge ran no faster than lookup alone.

So the gate learns, per band of what lookup offers this step (its best-paying share's expected
extra tokens, `AutoTree.given`), what the heads add when they draft: the accepted draft tokens
beyond the deepest one lookup proposed too (the heads' *marginal* tokens), and how many verify
slots their nodes take. It skips the heads where

    (1 + g) / (fixed + verify(1 + n))  >=  (1 + g + m) / (fixed + verify(1 + n + h) + d)

with g, n lookup's expected tokens and nodes, m and h the band's mean marginal tokens and head
nodes, verify() the measured verify cost at the step's context (the policy's profile) and d the
heads' measured drafting time (a running mean of the wall time of steps that follow a drafted
step: consuming that step, the LM head, the levels). A skipped head queues the step's tokens and
consumes them all in one forward when it next drafts (propose/single.py), so it loses nothing but
the forwards it did not run; that catch-up is left out of d (one forward over a gap, not a cost
per step). Every `EXPLORE_EVERY`-th step a band would skip, the heads draft anyway, so a band's
estimate follows a head that improves (a new version) or a workload that changes.

A band's estimate leans on the mean over all bands (a request's few dozen steps spread over seven
bands), which starts at one marginal token a step: so the gate starts by drafting and learns within
a request what the heads add. In a server it keeps what it learned from one request to the next
(`GateState`, held per variant and head version by propose/memory.VariantMemory). It only chooses
what is drafted; verification is unchanged, so decoding stays lossless.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from taps.core.tree import DraftTree, TokenPaths

# edges on lookup's expected extra tokens g: bands [0, 0.5), [0.5, 1), ..., [8, inf)
BAND_EDGES = (0.5, 1.0, 2.0, 3.0, 5.0, 8.0)
PRIOR_GAIN = 1.0  # marginal tokens a step before anything is measured: the heads draft
PRIOR_STEPS = 1.0  # ... worth this many steps of the pooled estimate
BAND_WEIGHT = 2.0  # a band's own steps are pulled to the pooled estimate by this many steps of it
EXPLORE_EVERY = 8
MEMORY_STEPS = 500.0  # observed steps per band; older ones fade in proportion
DRAFT_MS_DECAY = 0.9  # running mean of the heads' drafting time: weight of the past


@dataclass
class GateState:
    """What the gate learned: per band, the marginal tokens and head nodes summed over the steps
    the heads drafted, those steps, and the steps it skipped; the heads' drafting time."""

    gain: list[float] = field(default_factory=lambda: [0.0] * (len(BAND_EDGES) + 1))
    nodes: list[float] = field(default_factory=lambda: [0.0] * (len(BAND_EDGES) + 1))
    steps: list[float] = field(default_factory=lambda: [0.0] * (len(BAND_EDGES) + 1))
    skipped: list[int] = field(default_factory=lambda: [0] * (len(BAND_EDGES) + 1))
    draft_ms: float | None = None  # None until the heads have drafted once

    def add(self, band: int, gain: float, nodes: float) -> None:
        self.gain[band] += gain
        self.nodes[band] += nodes
        self.steps[band] += 1.0
        if self.steps[band] > MEMORY_STEPS:
            scale = MEMORY_STEPS / self.steps[band]
            self.gain[band] *= scale
            self.nodes[band] *= scale
            self.steps[band] = MEMORY_STEPS

    def expected(self, band: int) -> tuple[float, float]:
        """(marginal tokens, head nodes) a drafted step adds in `band`: the band's own mean pulled
        to the mean over every band (a request's few steps spread over seven bands), which starts
        at PRIOR_GAIN tokens and no nodes."""
        steps = sum(self.steps)
        pooled_gain = (sum(self.gain) + PRIOR_GAIN * PRIOR_STEPS) / (steps + PRIOR_STEPS)
        pooled_nodes = sum(self.nodes) / (steps + PRIOR_STEPS)
        weight = self.steps[band] + BAND_WEIGHT
        return ((self.gain[band] + BAND_WEIGHT * pooled_gain) / weight,
                (self.nodes[band] + BAND_WEIGHT * pooled_nodes) / weight)

    def timed(self, ms: float) -> None:
        self.draft_ms = ms if self.draft_ms is None else DRAFT_MS_DECAY * self.draft_ms + (1 - DRAFT_MS_DECAY) * ms


def band_of(given_tokens: float) -> int:
    return bisect.bisect_right(BAND_EDGES, given_tokens)


class HeadGate:
    """Per step: `drafts()` after the model-free members drafted and the heads were briefed;
    `drafted(ms)` with the heads' wall time when they did; `observe(tree, tokens)` after
    verification. `sized`: the heads' drafter bits; `policy`: a head's AutoTree (its `given`
    and its costs at the step's context)."""

    def __init__(self, policy, sized: int, state: GateState | None = None):
        self.policy, self.sized = policy, sized
        self.state = state if state is not None else GateState()
        self.decisions: list[bool] = []  # per step: the heads drafted
        self._band: int | None = None

    def drafts(self) -> bool:
        given_tokens, given_nodes = self.policy.given
        band = self._band = band_of(given_tokens)
        s = self.state
        draft = s.draft_ms is None or given_nodes == 0 or self._pays(band, given_tokens, given_nodes)
        if not draft:
            s.skipped[band] += 1
            draft = s.skipped[band] % EXPLORE_EVERY == 0  # now and then, measure what skipping forgoes
        self.decisions.append(draft)
        return draft

    def _pays(self, band: int, given_tokens: float, given_nodes: int) -> bool:
        s, costs = self.state, self.policy.now
        gain, nodes = s.expected(band)
        without = costs.fixed_ms + costs.verify(1 + given_nodes)
        with_heads = costs.fixed_ms + costs.verify(1 + given_nodes + nodes) + s.draft_ms
        return (1.0 + given_tokens + gain) / with_heads > (1.0 + given_tokens) / without

    def drafted(self, ms: float) -> None:
        self.state.timed(ms)

    def observe(self, tree: DraftTree, tokens: list[int]) -> None:
        """After a step the heads drafted: their marginal tokens (accepted draft tokens past the
        deepest one a model-free member proposed too) and their nodes verified alone."""
        if self._band is None or not self.decisions or not self.decisions[-1]:
            return
        drafters = tree.drafters.tolist()
        states = TokenPaths(tree).follow(tokens)[1:]  # per accepted draft token (and the bonus, if drafted)
        accepted = min(len(states), len(tokens) - 1)  # the bonus is never an accepted draft token
        lookup_depth = 0
        for depth, state in enumerate(states[:accepted], start=1):
            if any(drafters[node] & ~self.sized for node in state):
                lookup_depth = depth
        heads_only = sum(1 for mask in drafters[1:] if not mask & ~self.sized)
        self.state.add(self._band, float(accepted - lookup_depth), float(heads_only))
        self._band = None
