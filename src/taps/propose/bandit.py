"""Learned routing (`route-bandit`): a bandit over the heads that learns, across requests, which
head earns the most tokens per verifier call, starting from the confidence router's opinion.

The paper routes each request with a fixed rule (the tree's mean confidence or entropy) and names
this as its limitation: the rule never learns that on some requests the head it prefers is the
worse one. BanditRouter is a RoutedProposer whose decision is UCB1-Tuned (Auer, Cesa-Bianchi and
Fischer 2002; as BanditSpec does for drafter choice) over the heads:

- arm: a head (member). A decision, per turn or per step as the granularity says, is a pull.
- reward of a pull: tokens per verifier call while the pulled head drafts, i.e. accepted draft
  tokens + 1 (the bonus) averaged over the pull's verified steps. Per verifier call, not per
  second: the heads of a composition share one tree shape, so their draft and verify costs are
  alike and tokens per call orders them as tokens per second does, while wall time on a shared
  machine is noise (a timed reward would make decisions, and a study's records, differ from run
  to run). A head of another cost (prompt lookup) is favoured less than its speed deserves.
- prior: the confidence router's score on the reward's scale. For a calibrated tree the expected
  number of accepted nodes is the sum of the node confidences c(v) = exp(cumulative log-prob)
  (siblings exclude each other), so prior = 1 + sum c(v), clamped to [1, 1 + depth]; with
  equal-size trees it ranks the heads as mean confidence does. It counts as `prior_pulls` pulls
  of evidence: before any reward the bandit picks what the confidence router picks.
- similar requests: statistics are kept per context, the head the prior favours on this decision
  (for two heads: "requests the confidence router calls math" and those it calls chat). So the
  bandit learns where the confidence router is right and where it should be overruled.

Index of head i in context k, with rewards normalised to [0, 1] by the tree depth:
    mean_i  = (prior_pulls * prior_i + sum of rewards_i) / (prior_pulls + n_i)
    bonus_i = sqrt(ln(N + 1) / (n_i + prior_pulls) * min(1/4, var_i + sqrt(2 ln(N + 1) / (n_i + prior_pulls))))
over the n_i rewarded pulls of head i and the N of all heads in context k; the highest index
wins, ties go to the first head. UCB has no randomness: given the rewards (deterministic for a
decode seed), the decisions are too.

The state (BanditState) outlives a proposer: propose/factory.HeadPool keeps one per variant, so
`taps serve` learns across requests and `taps eval` across the questions of a run. It is updated
at every observed step (the running mean of the current pull is replaced), so it is always
current, even for a request that is cancelled. `replay` rebuilds it from result records (the
decisions' route_context / route_chosen and the accepted tokens of the steps the proposer
observed): a resumed `taps eval` continues from where the interrupted one stopped.

Decisions are logged as the other routers' are (RoutedProposer.decisions, one RouteDecision per
decision, with the prior and the context); verification is untouched, so decoding is lossless.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import Tensor

from taps.core.proposer import Proposer
from taps.propose.routed import RouteDecision, RoutedProposer, RoutingSignal
from taps.core.tree import DraftTree
from taps.core.verify import Acceptance


def expected_tokens(tree: DraftTree) -> float:
    """The confidence prior: 1 + the sum of the non-root node confidences (unclamped)."""
    return 1.0 + float(tree.logp[1:].exp().sum()) if tree.size > 1 else 1.0


# the grammar's `bandit` signal: its score is the prior; BanditRouter learns on top of it
BANDIT = RoutingSignal("bandit", expected_tokens, higher_wins=True)


@dataclass
class ArmStats:
    pulls: int = 0  # rewarded pulls (a decision whose head drafted at least one observed step)
    total: float = 0.0  # sum of their normalised rewards
    squares: float = 0.0  # sum of their squares

    @property
    def mean(self) -> float:
        return self.total / self.pulls if self.pulls else 0.0


class BanditState:
    """What a route-bandit variant has learned: per context, per head, the pulls and rewards."""

    def __init__(self, names: Sequence[str], depth: int, prior_pulls: float = 1.0):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if prior_pulls <= 0:
            raise ValueError(f"prior_pulls must be > 0, got {prior_pulls}")
        self.names, self.depth, self.prior_pulls = list(names), depth, prior_pulls
        self.stats: dict[int, list[ArmStats]] = {}  # context -> one ArmStats per head

    def _norm(self, tokens_per_call: float) -> float:
        """Tokens per call in [1, 1 + depth] -> [0, 1]."""
        return min(1.0, max(0.0, (tokens_per_call - 1.0) / self.depth))

    def arms(self, context: int) -> list[ArmStats]:
        return self.stats.setdefault(context, [ArmStats() for _ in self.names])

    def indices(self, prior: Sequence[float]) -> tuple[int, list[float]]:
        """(context, every head's index) for a decision whose trees give `prior`."""
        if len(prior) != len(self.names):
            raise ValueError(f"{len(prior)} prior scores for {len(self.names)} heads")
        context = max(range(len(prior)), key=lambda i: prior[i])  # the first on ties
        arms = self.stats.get(context) or [ArmStats() for _ in self.names]
        log_n = math.log(sum(a.pulls for a in arms) + 1)
        w = self.prior_pulls
        out = []
        for p, arm in zip(prior, arms):
            n = arm.pulls + w
            mean = (w * self._norm(p) + arm.total) / n
            var = max(0.0, arm.squares / arm.pulls - arm.mean ** 2) if arm.pulls else 0.25
            out.append(mean + math.sqrt(log_n / n * min(0.25, var + math.sqrt(2 * log_n / n))))
        return context, out

    def choose(self, prior: Sequence[float]) -> tuple[int, int, list[float]]:
        """(context, chosen head, indices): the highest index, the first head on ties."""
        context, index = self.indices(prior)
        return context, max(range(len(index)), key=lambda i: index[i]), index

    def reward(self, context: int, arm: int, tokens_per_call: float, previous: float | None = None) -> None:
        """A pull's reward (tokens per verifier call); `previous`: the same pull's earlier running
        value, which this one replaces (the pull goes on)."""
        stats, r = self.arms(context)[arm], self._norm(tokens_per_call)
        if previous is None:
            stats.pulls += 1
        else:
            old = self._norm(previous)
            stats.total -= old
            stats.squares -= old * old
        stats.total += r
        stats.squares += r * r

    def pull(self, context: int, arm: int) -> "Pull":
        return Pull(self, context, arm)

    def replay(self, records: Iterable[dict]) -> int:
        """Learn from result records (eval/records.py) as the live router did: each decision
        (a step whose step_info has route_scores and route_context) starts a pull, rewarded by
        the steps the proposer observed (all but a record's last). Returns the pulls read."""
        pulls = 0
        for record in records:
            infos, accepted = record.get("step_info") or [], record.get("accepted") or []
            pull = None
            for k, info in enumerate(infos):
                info = info or {}
                if info.get("route_scores") is not None and info.get("route_context") is not None:
                    pull = self.pull(int(info["route_context"]), int(info["route_chosen"]))
                    pulls += 1
                if pull is not None and k < len(infos) - 1:
                    pull.step(int(accepted[k]))
        return pulls

    def summary(self) -> list[dict]:
        """Per context and head: rewarded pulls and mean tokens per verifier call (for /metrics)."""
        return [{"context": self.names[c], "head": self.names[i], "pulls": a.pulls,
                 "tokens_per_call": 1.0 + a.mean * self.depth if a.pulls else None}
                for c in sorted(self.stats) for i, a in enumerate(self.stats[c])]


class Pull:
    """One decision's head drafting: each verified step updates its running reward in the state."""

    def __init__(self, state: BanditState, context: int, arm: int):
        self.state, self.context, self.arm = state, context, arm
        self.tokens, self.calls, self._reward = 0, 0, None

    def step(self, accepted: int) -> None:
        self.tokens += accepted + 1
        self.calls += 1
        reward = self.tokens / self.calls
        self.state.reward(self.context, self.arm, reward, self._reward)
        self._reward = reward


class BanditRouter(RoutedProposer):
    """Routes as RoutedProposer does (every head drafts at a decision; per turn only the winner
    drafts afterwards), deciding with a BanditState shared with the variant's other proposers."""

    def __init__(self, proposers: Sequence[Proposer], state: BanditState, per_turn: bool = False,
                 names: Sequence[str] | None = None):
        super().__init__(proposers, signal=BANDIT, per_turn=per_turn, names=names)
        if len(state.names) != len(self.proposers):
            raise ValueError(f"a bandit state over {len(state.names)} heads for {len(self.proposers)} drafters")
        self.state = state
        self._pull: Pull | None = None  # the current decision's

    def start(self, features: Tensor, tokens: Tensor) -> None:
        super().start(features, tokens)
        self._pull = None

    def _decide(self, trees: Sequence[DraftTree]) -> RouteDecision:
        prior = tuple(min(expected_tokens(t), 1.0 + self.state.depth) for t in trees)
        context, chosen, index = self.state.choose(prior)
        self._pull = self.state.pull(context, chosen)
        return RouteDecision(turn=self._turn, step=self._step, chosen=chosen, scores=tuple(index), signal="bandit",
                             prior=prior, context=context)

    def observe(self, tree: DraftTree, acceptance: Acceptance, features: Tensor) -> None:
        if self._pull is not None:
            self._pull.step(acceptance.accepted)
        super().observe(tree, acceptance, features)
