"""SingleProposer: one EAGLE head drafting EAGLE-2 dynamic trees."""

from __future__ import annotations

import torch
from torch import Tensor

from taps.config import TreeConfig
from taps.drafter.context import HeadContext, consume
from taps.drafter.expand import expand_tree
from taps.drafter.head import EagleHead
from taps.tree import DraftTree
from taps.verify import Acceptance


class SingleProposer:
    def __init__(self, head: EagleHead, tree: TreeConfig = TreeConfig(), source: int = 0):
        self.head = head
        self.tree = tree
        self.source = source
        self._ctx: HeadContext | None = None

    def start(self, features: Tensor, tokens: Tensor) -> None:
        if tokens.shape[0] != features.shape[0] + 1:
            raise ValueError(f"start(): {tokens.shape[0]} tokens for {features.shape[0]} features; expected one more token")
        self._ctx = consume(self.head, None, tokens[1:], features)

    def propose(self) -> DraftTree:
        if self._ctx is None:
            raise RuntimeError("propose() before start()")
        return expand_tree(self.head, self._ctx, self.tree, self.source)

    def observe(self, acceptance: Acceptance, features: Tensor) -> None:
        next_tokens = torch.tensor(acceptance.new_tokens, dtype=torch.long, device=features.device)  # [A+1]
        self._ctx = consume(self.head, self._ctx, next_tokens, features)
