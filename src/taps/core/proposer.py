"""The Proposer protocol: the only thing decode.py knows about drafting.

A routed or merged proposer is a new class with these four methods; decode.py and verify.py
do not change. Contract (batch size 1):
- start(features, tokens): a new context. tokens [T+1] is the whole sequence so far, ending
  with the pending token the target has not seen; features [T, H] are the target's last-layer
  features at positions 0..T-1.
- propose(): a DraftTree whose root token is the pending token.
- observe(tree, acceptance, features): `tree` is what this proposer's propose() returned (before
  the decoder trimmed it), the target accepted `acceptance.nodes` of the verified tree and emitted
  `acceptance.bonus`; features [A+1, H] are the target's features at the accepted nodes. A
  proposer keeps no tree between calls: what it learns from its own tree (a policy's
  calibration, lookup's acceptance rate, a merge's accepted drafters) it reads from `tree`, and a
  composition finds its members' trees in `tree.parts`.
- step_info() -> StepInfo: the proposer's record of the tree it just proposed (routing scores,
  merge sizes, auto-tree sizes; StepInfo() if none); decode.py stores it in that step's
  StepStats.info.
Plain decoding is PlainProposer: a root-only tree each step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torch import Tensor

from taps.core.tree import DraftTree
from taps.core.verify import Acceptance


@dataclass(frozen=True)
class StepInfo:
    """A proposer's record of one proposed tree: each proposer fills its own fields, the others stay
    None. Typed here, in the core, so the decoder, the results records and the server read one shape.
    as_json() is the `step_info` entry of a results record and of `taps generate --json`: only the
    fields the proposer reports, in this order (records written before StepInfo read the same)."""

    route_chosen: int | None = None  # routing: the drafter whose tree was verified
    route_scores: tuple[float, ...] | None = None  # routing: every drafter's score (None: no decision this step)
    route_prior: tuple[float, ...] | None = None  # bandit: the confidence prior of the decision
    route_context: int | None = None  # bandit: the context whose statistics decided
    merge_input_sizes: tuple[int, ...] | None = None  # merging: nodes (root included) of each drafter's tree
    merge_size: int | None = None  # merging: nodes of the merged tree, before the decoder's depth trim
    tree_levels: int | None = None  # auto tree: the draft levels its policy chose
    tree_tokens: int | None = None  # auto tree: the tree tokens its policy chose

    def as_json(self) -> dict:
        out: dict = {}
        if self.route_chosen is not None:
            out.update(route_chosen=self.route_chosen,
                       route_scores=None if self.route_scores is None else list(self.route_scores))
        if self.route_prior is not None:
            out.update(route_prior=list(self.route_prior), route_context=self.route_context)
        if self.merge_size is not None:
            out.update(merge_input_sizes=list(self.merge_input_sizes), merge_size=self.merge_size)
        if self.tree_levels is not None:
            out.update(tree_levels=self.tree_levels, tree_tokens=self.tree_tokens)
        return out


@runtime_checkable
class Proposer(Protocol):
    def start(self, features: Tensor, tokens: Tensor) -> None: ...

    def propose(self) -> DraftTree: ...

    def observe(self, tree: DraftTree, acceptance: Acceptance, features: Tensor) -> None: ...

    def step_info(self) -> StepInfo: ...


class PlainProposer:
    """Plain decoding: the root alone every step (verifying it is one step of the target)."""

    def __init__(self) -> None:
        self._pending: int | None = None  # the token the target has not seen yet
        self._device = None

    def start(self, features: Tensor, tokens: Tensor) -> None:
        self._pending, self._device = int(tokens[-1]), tokens.device

    def propose(self) -> DraftTree:
        if self._pending is None:
            raise RuntimeError("propose() before start()")
        return DraftTree.root_only(self._pending, self._device)

    def observe(self, tree: DraftTree, acceptance: Acceptance, features: Tensor) -> None:
        self._pending = acceptance.bonus

    def step_info(self) -> StepInfo:
        return StepInfo()


class ProposerGroup:
    """What every composition of several proposers shares: the members, their names, and the
    turn / step counters that key its decision logs to DecodeResult.steps."""

    def __init__(self, proposers: Sequence[Proposer], names: Sequence[str] | None = None):
        if not proposers:
            raise ValueError(f"{type(self).__name__} needs at least one drafter")
        if names is not None and len(names) != len(proposers):
            raise ValueError(f"{len(names)} names for {len(proposers)} drafters")
        self.proposers = list(proposers)
        self.names = list(names) if names is not None else [str(i) for i in range(len(proposers))]
        self._turn = -1  # start() calls so far, minus one
        self._step = 0  # proposals in the current turn

    def start(self, features: Tensor, tokens: Tensor) -> None:
        for proposer in self.proposers:
            proposer.start(features, tokens)
        self._turn += 1
        self._step = 0

    def _check_started(self) -> None:
        if self._turn < 0:
            raise RuntimeError("propose() before start()")

    def observe(self, tree: DraftTree, acceptance: Acceptance, features: Tensor) -> None:
        """Every member that drafted `tree` (its tree in tree.parts) consumes the step."""
        for proposer, part in zip(self.proposers, tree.parts):
            if part is not None:
                proposer.observe(part, acceptance, features)
