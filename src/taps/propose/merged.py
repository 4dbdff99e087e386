"""MergedProposer: several drafters each draft a full tree; their merge is verified in one pass.

docs/spec.md §4 merges (the paper's disjoint merge, and trie and budget merges), for any number
of drafters. The merge itself is a pure function of the trees (taps.core.tree.merge_disjoint |
merge_trie | merge_budget, bound to the tree budget by the factory), passed in as `merge`:
- disjoint: every tree under one shared root, no cross-tree attention (the paper's merge);
- trie:     nodes with equal token paths are one node (identical proposals cost one slot);
- budget:   the trie reranked by confidence to the single-tree budget `total_tokens`.
Every drafter consumes every step's accepted features, so all stay in sync. The merged tree keeps
each node's drafters (`drafters`: the bitmask of all of them; a step is credited to the lowest) and the
members' own trees (`parts`, handed back to each member's observe()).
Verification is unchanged: greedy takes the longest match, sampling tries each distinct child
token once (verify.py pools nodes that share a token path), so the merge is lossless.

Diagnostics: `records` holds one MergeRecord per step (input tree sizes, merged size, and, once
observed, the bitmask of drafters that proposed the accepted token path). `turn` counts start()
calls and `step` indexes that run's DecodeResult.steps. The decoder does not call observe() after
its last step, so that step's `accepted_drafters` stays None.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from torch import Tensor

from taps.core.proposer import Proposer, ProposerGroup, StepInfo
from taps.core.tree import DraftTree, TokenPaths, merge_disjoint
from taps.core.verify import Acceptance


@dataclass
class MergeRecord:
    turn: int  # 0-based count of start() calls
    step: int  # index into that run's DecodeResult.steps
    input_sizes: tuple[int, ...]  # nodes (root included) of each drafter's tree
    merged_size: int  # nodes (root included) of the merged tree, before the decoder's depth trim
    accepted_drafters: int | None = None  # bitmask of drafters that proposed the accepted path (0: none accepted)


def accepted_path_drafters(tree: DraftTree, tokens: list[int]) -> int:
    """Bitmask of the drafters that proposed the whole token path `tokens` (draft tokens below the
    root) in `tree`: OR over every node reached by that path (in a disjoint merge, one per tree)."""
    states = TokenPaths(tree).follow(tokens)
    if len(states) <= len(tokens):  # the path leaves the tree
        return 0
    masks, out = tree.drafters.tolist(), 0
    for node in states[-1]:
        out |= masks[node]
    return out


class MergedProposer(ProposerGroup):
    def __init__(self, proposers: Sequence[Proposer],
                 merge: Callable[[Sequence[DraftTree]], DraftTree] = merge_disjoint,
                 names: Sequence[str] | None = None,
                 observe_merge: Callable[[Sequence[DraftTree], list[int]], None] | None = None,
                 first: Sequence[int] = (), brief: Callable[[list[DraftTree], int | None], None] | None = None,
                 gate=None):
        super().__init__(proposers, names)
        self.merge = merge
        # members that draft first (by index), and what the others are told of their trees (and the
        # context the first drafted at) before they draft (a budget merge by cost:
        # drafter/auto_tree.py brief_sized_members)
        self.first, self.brief = tuple(first), brief
        # what the merge learns from each verified step: the members' own trees and the emitted
        # tokens (a budget merge by cost: drafter/auto_tree.py observe_budget_merge)
        self.observe_merge = observe_merge
        # whether the other members draft at all this step, after the first ones did (a budget merge
        # by cost: propose/head_gate.HeadGate); a member left out verifies nothing of its own and
        # observes the step from a root-only tree
        self.gate = gate
        self.records: list[MergeRecord] = []

    def propose(self) -> DraftTree:
        self._check_started()
        trees: list[DraftTree | None] = [None] * len(self.proposers)
        for i in self.first:
            trees[i] = self.proposers[i].propose()
        if self.brief is not None:  # with the context the first member drafted at
            self.brief([trees[i] for i in self.first], getattr(self.proposers[self.first[0]], "context_length", None))
        gated = self.gate is not None and bool(self.first)
        heads_draft = not gated or self.gate.drafts()
        if not heads_draft:
            root = trees[self.first[0]]  # every member's tree has the pending token at its root
            trees = [t if t is not None else DraftTree.root_only(int(root.tokens[0]), root.tokens.device) for t in trees]
        start = time.perf_counter()
        for i, proposer in enumerate(self.proposers):
            if trees[i] is None:
                trees[i] = proposer.propose()
        if gated and heads_draft:
            # a step's drafting, without catching up on the steps the heads were left out of
            caught_up = sum(getattr(p, "last_catch_up_s", 0.0) for i, p in enumerate(self.proposers) if i not in self.first)
            self.gate.drafted(1e3 * (time.perf_counter() - start - caught_up))
        merged = self.merge(trees)
        self.records.append(MergeRecord(turn=self._turn, step=self._step, input_sizes=tuple(t.size for t in trees),
                                        merged_size=merged.size))
        self._step += 1
        return replace(merged, parts=tuple(trees))

    def observe(self, tree: DraftTree, acceptance: Acceptance, features: Tensor) -> None:
        # by token path, not node id: the decoder may have trimmed the tree's depth
        self.records[-1].accepted_drafters = accepted_path_drafters(tree, acceptance.tokens[1:].tolist())
        if self.observe_merge is not None and tree.parts:
            self.observe_merge(tree.parts, acceptance.new_tokens)
        if self.gate is not None:
            self.gate.observe(tree, acceptance.new_tokens)
        super().observe(tree, acceptance, features)

    def step_info(self) -> StepInfo:
        if not self.records:
            return StepInfo()
        return StepInfo(merge_input_sizes=self.records[-1].input_sizes, merge_size=self.records[-1].merged_size)
