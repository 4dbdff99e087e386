"""RoutedProposer: several drafters each draft a full tree; the best-scoring one is verified.

docs/spec.md §4, confidence routing (reference behaviour) and entropy routing, for any number of drafters:
- every drafter drafts a full tree from the same context;
- a routing signal scores each tree from its own nodes (mean confidence over the non-root nodes,
  higher wins; or mean draft entropy, lower wins); ties go to the first drafter;
- the winning tree is verified, with its `drafters` relabelled to the winner's index, so the
  decoder's StepStats.credited_drafter names the chosen drafter whenever a draft token is accepted;
- granularity: per step (decide at every draft/verify step, the reference confidence router) or
  per turn (decide once, from the first trees after start(), as the reference entropy router).

Every drafter consumes every step's accepted features (observe), so all draft caches stay in sync
with the committed tokens and switching drafters costs no recomputation of the target. With a
per-turn decision the losers are not needed again until the next start(), which re-encodes every
drafter from the whole context, so only the winner is kept in sync: the verified tree's `parts`
hold the trees of the members that observe this step (the others are None).

Each decision is logged once, in `decisions` (one RouteDecision per decision: turn, step, chosen
drafter, every drafter's score); `turn` counts start() calls and `step` indexes that turn's
DecodeResult.steps, so the log joins the decoder's step stats; `chosen` (the verified drafter at
every step of the current turn) is read from it. A decision is `_decide(trees)`: the signal's
best score here; the learned router (propose/bandit.BanditRouter, signal `bandit`) overrides it.
Verification is untouched:
whichever tree is verified, the output distribution is the target's (docs/spec.md §3).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from taps.core.proposer import Proposer, ProposerGroup, StepInfo
from taps.core.tree import DraftTree


def mean_confidence(tree: DraftTree) -> float:
    """Mean of c(v) = exp(cumulative draft log-prob) over the non-root nodes (0 for a root-only tree)."""
    return float(tree.logp[1:].exp().mean()) if tree.size > 1 else 0.0


def mean_entropy(tree: DraftTree) -> float:
    """Mean draft entropy (nats) over the non-root nodes (inf for a root-only tree)."""
    return float(tree.entropy[1:].mean()) if tree.size > 1 else math.inf


@dataclass(frozen=True)
class RoutingSignal:
    name: str
    score: Callable[[DraftTree], float]
    higher_wins: bool

    def choose(self, scores: Sequence[float]) -> int:
        """Index of the winning score; the first one on ties."""
        pick = max if self.higher_wins else min
        return pick(range(len(scores)), key=lambda i: scores[i])


CONFIDENCE = RoutingSignal("confidence", mean_confidence, higher_wins=True)
ENTROPY = RoutingSignal("entropy", mean_entropy, higher_wins=False)


@dataclass(frozen=True)
class RouteDecision:
    turn: int  # 0-based count of start() calls (one decode run / chat turn each)
    step: int  # index into that run's DecodeResult.steps
    chosen: int  # index of the drafter whose tree was verified
    scores: tuple[float, ...]  # every drafter's score under `signal`, in drafter order
    signal: str  # "confidence" (higher wins) | "entropy" (lower wins) | "bandit" (learned index, higher wins)
    prior: tuple[float, ...] | None = None  # bandit: the confidence prior (expected tokens per verifier call)
    context: int | None = None  # bandit: the context whose statistics decided (the prior's favourite)

    def info(self) -> StepInfo:
        """This decision in a step's record (StepStats.info)."""
        return StepInfo(route_chosen=self.chosen, route_scores=self.scores, route_prior=self.prior,
                        route_context=self.context)


class RoutedProposer(ProposerGroup):
    def __init__(self, proposers: Sequence[Proposer], signal: RoutingSignal = CONFIDENCE, per_turn: bool = False,
                 names: Sequence[str] | None = None):
        super().__init__(proposers, names)
        self.signal = signal
        self.per_turn = per_turn
        self.decisions: list[RouteDecision] = []
        self._turn_start = 0  # index of the current turn's first decision

    def start(self, features: Tensor, tokens: Tensor) -> None:
        super().start(features, tokens)
        self._turn_start = len(self.decisions)

    @property
    def chosen(self) -> list[int]:
        """The verified drafter at every step of the current turn."""
        made = self.turn_decisions()
        return [made[0].chosen] * self._step if self.per_turn and made else [d.chosen for d in made]

    def propose(self) -> DraftTree:
        self._check_started()
        made = self.turn_decisions() if self.per_turn else []
        if made:  # per-turn routing, decided earlier in this turn
            winner = made[0].chosen
            trees = [self.proposers[i].propose() if i == winner else None for i in range(len(self.proposers))]
        else:
            trees = [proposer.propose() for proposer in self.proposers]
            self.decisions.append(self._decide(trees))
            winner = self.decisions[-1].chosen
        self._step += 1
        tree = trees[winner]
        drafters = torch.where(tree.drafters != 0, torch.full_like(tree.drafters, 1 << winner), tree.drafters)  # [N] the winner's bit
        # per turn, the losers are not kept in sync (the next start() re-encodes them)
        parts = tuple(t if i == winner or not self.per_turn else None for i, t in enumerate(trees))
        return replace(tree, drafters=drafters, parts=parts)

    def _decide(self, trees: Sequence[DraftTree]) -> RouteDecision:
        """The decision of this step from every drafter's tree: the signal's best score."""
        scores = tuple(self.signal.score(t) for t in trees)
        return RouteDecision(turn=self._turn, step=self._step, chosen=self.signal.choose(scores), scores=scores,
                             signal=self.signal.name)

    def step_info(self) -> StepInfo:
        """The last proposal's routing: chosen drafter, and every score if a decision was made then."""
        made = self.turn_decisions()
        if made and made[-1].step == self._step - 1:
            return made[-1].info()
        return StepInfo(route_chosen=made[-1].chosen if made else None)

    def turn_decisions(self, turn: int | None = None) -> list[RouteDecision]:
        """Decisions of one turn (default: the current one)."""
        if turn is None or turn == self._turn:
            return self.decisions[self._turn_start:]
        return [d for d in self.decisions if d.turn == turn]
