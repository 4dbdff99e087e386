"""RoutedProposer: several drafters each draft a full tree; the best-scoring one is verified.

SPEC §4, confidence routing (reference behaviour) and entropy routing, for any number of drafters:
- every drafter drafts a full tree from the same context;
- a routing signal scores each tree from its own nodes (mean confidence over the non-root nodes,
  higher wins; or mean draft entropy, lower wins); ties go to the first drafter;
- the winning tree is verified, with `source` relabelled to the winner's index, so the decoder's
  StepStats.source names the chosen drafter whenever a draft token is accepted;
- granularity: per step (decide at every draft/verify step, the reference confidence router) or
  per turn (decide once, from the first trees after start(), as the reference entropy router).

Every drafter consumes every step's accepted features (observe), so all draft caches stay in sync
with the committed tokens and switching drafters costs no recomputation of the target. With a
per-turn decision the losers are not needed again until the next start(), which re-encodes every
drafter from the whole context, so only the winner is kept in sync.

Each decision is logged in `decisions` (one RouteDecision per decision: turn, step, chosen
drafter, every drafter's score); `turn` counts start() calls and `step` indexes that turn's
DecodeResult.steps, so the log joins the decoder's step stats. Verification is untouched:
whichever tree is verified, the output distribution is the target's (SPEC §3).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from taps.propose.base import Proposer, ProposerGroup
from taps.tree import DraftTree
from taps.verify import Acceptance


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
    signal: str  # "confidence" (higher wins) | "entropy" (lower wins)


class RoutedProposer(ProposerGroup):
    def __init__(self, proposers: Sequence[Proposer], signal: RoutingSignal = CONFIDENCE, per_turn: bool = False,
                 names: Sequence[str] | None = None):
        super().__init__(proposers, names)
        self.signal = signal
        self.per_turn = per_turn
        self.decisions: list[RouteDecision] = []
        self.chosen: list[int] = []  # the verified drafter at every step of the current turn
        self._winner: int | None = None  # per-turn decision, once made

    def start(self, features: Tensor, tokens: Tensor) -> None:
        super().start(features, tokens)
        self._winner = None
        self.chosen = []

    def propose(self) -> DraftTree:
        self._check_started()
        if self._winner is not None:  # per-turn routing, decided earlier in this turn
            winner, tree = self._winner, self.proposers[self._winner].propose()
        else:
            trees = [proposer.propose() for proposer in self.proposers]
            scores = tuple(self.signal.score(t) for t in trees)
            winner = self.signal.choose(scores)
            tree = trees[winner]
            self.decisions.append(RouteDecision(turn=self._turn, step=self._step, chosen=winner, scores=scores,
                                                signal=self.signal.name))
            if self.per_turn:
                self._winner = winner
        self.chosen.append(winner)
        self._step += 1
        source = torch.where(tree.source >= 0, torch.full_like(tree.source, winner), tree.source)  # [N]
        return replace(tree, source=source, sources=None)

    def observe(self, acceptance: Acceptance, features: Tensor) -> None:
        keep_in_sync = [self._winner] if self._winner is not None else range(len(self.proposers))
        for i in keep_in_sync:
            self.proposers[i].observe(acceptance, features)

    def step_info(self) -> dict:
        """The last proposal's routing: chosen drafter, and every score if a decision was made then."""
        last = self.decisions[-1] if self.decisions else None
        fresh = last is not None and last.turn == self._turn and last.step == self._step - 1
        return {"route_chosen": self.chosen[-1] if self.chosen else None,
                "route_scores": list(last.scores) if fresh else None}

    def turn_decisions(self, turn: int | None = None) -> list[RouteDecision]:
        """Decisions of one turn (default: the current one)."""
        turn = self._turn if turn is None else turn
        return [d for d in self.decisions if d.turn == turn]
