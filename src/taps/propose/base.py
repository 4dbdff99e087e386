"""The Proposer protocol: the only thing decode.py knows about drafting.

A routed or merged proposer is a new class with these three methods; decode.py and verify.py
do not change. Contract (batch size 1):
- start(features, tokens): a new context. tokens [T+1] is the whole sequence so far, ending
  with the pending token the target has not seen; features [T, H] are the target's last-layer
  features at positions 0..T-1.
- propose(): a DraftTree whose root token is the pending token.
- observe(acceptance, features): the target accepted `acceptance.nodes` of the last tree and
  emitted `acceptance.bonus`; features [A+1, H] are the target's features at the accepted nodes.
Optionally, step_info() -> dict: the proposer's record of the tree it just proposed (routing
scores, merge sizes); decode.py stores it in that step's StepStats.info.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from torch import Tensor

from taps.tree import DraftTree
from taps.verify import Acceptance


@runtime_checkable
class Proposer(Protocol):
    def start(self, features: Tensor, tokens: Tensor) -> None: ...

    def propose(self) -> DraftTree: ...

    def observe(self, acceptance: Acceptance, features: Tensor) -> None: ...


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
