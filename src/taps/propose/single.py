"""SingleProposer: one EAGLE head drafting EAGLE-2 dynamic trees, of a fixed shape or, with an
AutoTree policy, of the depth and size its measured costs and calibrated confidences favour.

The head consumes the prompt at start() (part of the prefill, as the target's own pass over it),
and each step's accepted tokens lazily: observe() queues them and the head feeds everything queued
in one forward when it next drafts. A head that drafts every step consumes exactly what it did
before, one step later; one a composition leaves out for a while (a per-turn router's other heads,
a budget merge's heads while prompt lookup copies: propose/head_gate.py) pays one forward over
the whole gap when it drafts again, and nothing while it waits."""

from __future__ import annotations

import time

import torch
from torch import Tensor

from taps.core.config import TreeConfig
from taps.drafter.context import HeadContext, consume
from taps.drafter.expand import expand_tree
from taps.drafter.head import EagleHead
from taps.core.proposer import StepInfo
from taps.core.tree import DraftTree, TokenPaths
from taps.core.verify import Acceptance


class SingleProposer:
    def __init__(self, head: EagleHead, tree: TreeConfig = TreeConfig(), drafter: int = 0, policy=None):
        self.head = head
        self.tree = tree  # with a policy: the caps on depth, tokens and beams
        self.drafter = drafter  # its index in a composition: bit `drafter` of its trees' drafters
        self.policy = policy  # drafter.auto_tree.AutoTree or None (fixed trees)
        self._ctx: HeadContext | None = None
        self._pending: list[tuple[Tensor, Tensor]] | None = None  # (next tokens [T], features [T, F]) not consumed yet
        self.consumed = 0  # consume() calls so far (each a head forward)
        # seconds of the last propose() spent catching up on more than one queued step (a gap the
        # head was left out of; 0.0 when it drafted the step before): not what a step's drafting costs
        self.last_catch_up_s = 0.0

    def start(self, features: Tensor, tokens: Tensor) -> None:
        if tokens.shape[0] != features.shape[0] + 1:
            raise ValueError(f"start(): {tokens.shape[0]} tokens for {features.shape[0]} features; expected one more token")
        self._ctx, self._pending = None, [(tokens[1:], features)]
        self._catch_up()

    def _catch_up(self) -> HeadContext:
        """The head's context with every queued pair consumed, in one head forward."""
        self.last_catch_up_s = 0.0
        if self._pending:
            start = time.perf_counter()
            tokens = torch.cat([t for t, _ in self._pending]) if len(self._pending) > 1 else self._pending[0][0]
            features = torch.cat([f for _, f in self._pending]) if len(self._pending) > 1 else self._pending[0][1]
            self._ctx = consume(self.head, self._ctx, tokens, features)
            if len(self._pending) > 1:
                self.last_catch_up_s = time.perf_counter() - start
            self._pending.clear()
            self.consumed += 1
        return self._ctx

    def propose(self) -> DraftTree:
        if self._pending is None:
            raise RuntimeError("propose() before start()")
        self._catch_up()
        if self.policy is not None:  # the verify cost it weighs is the one at this context
            self.policy.context = self._ctx.length
        return expand_tree(self.head, self._ctx, self.tree, self.drafter, self.policy)

    def observe(self, tree: DraftTree, acceptance: Acceptance, features: Tensor) -> None:
        if self.policy is not None and tree.size > 1:
            # by token path, not node id: the decoder may have trimmed the tree, a budget merge cut it,
            # or a router verified another member's. The bonus token counts: a node it matches was not
            # verified but would have been accepted (a verified one never matches it), so a node left
            # out is not taken for a rejected one, which would teach the calibration to leave it out
            on_path = path_nodes(tree, acceptance.new_tokens)  # [N] bool
            self.policy.observe(tree.confidence[1:], on_path[1:])
        next_tokens = torch.tensor(acceptance.new_tokens, dtype=torch.long, device=features.device)  # [A+1]
        self._pending.append((next_tokens, features))

    def step_info(self) -> StepInfo:
        """With a policy: the levels drafted and tree tokens it chose for the last tree."""
        if self.policy is None or not self.policy.chosen:
            return StepInfo()
        levels, tokens = self.policy.chosen[-1]
        return StepInfo(tree_levels=levels, tree_tokens=tokens)


def path_nodes(tree: DraftTree, tokens: list[int]) -> Tensor:
    """[N] bool: the nodes on the path from the root that spells `tokens` (as far as it goes)."""
    on = torch.zeros(tree.size, dtype=torch.bool)
    for state in TokenPaths(tree).follow(tokens):
        on[state] = True
    return on
