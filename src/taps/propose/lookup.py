"""LookupProposer: prompt-lookup decoding as a Proposer (a model-free specialist).

Drafts are continuations of earlier occurrences of the sequence's last n tokens, in the prompt
or in the output so far (Saxena's prompt lookup decoding; transformers' `prompt_lookup_num_tokens`).
It costs no model forward, and it is strongest exactly where a chat head is weakest: copying
numbers and names of a GSM8K question, repeating code or a list the answer builds on.

The tree: for n = max_ngram down to min_ngram, the continuations (up to `depth` tokens) that
follow the most recent occurrences of the last n tokens are inserted into a trie under the root,
longest n and most recent occurrence first, up to `top_k` continuations; the datastore's nodes
join the same trie; and the `total_tokens - 1` nodes with the best scores (below) are kept, of
either source. (Filled in insertion order instead, a long first continuation took the budget of
the others and the datastore got only what prompt lookup left: nothing whenever prompt lookup
found a few matches, which a one-token match almost always does.)
A continuation that runs into the sequence's end repeats its period (`continuations` says why).
Node scores make the tree usable in routed and merged compositions, whose rules read them, and
in `--tree auto`'s budget merge, which reads exp(score) as the node's acceptance probability
(drafter/auto_tree.py: merge_budget_by_cost). Each source keeps its own running estimate, because
the two fail differently: prompt lookup is near certain inside a repeated span and useless
elsewhere, while a datastore's frequencies say how often *other* answers went on this way.
- prompt lookup:  logp(node) = sum_{j=1..depth} log q(n, j) + log(1 / (rank + 1)), where
  q(n, j) is the running rate at which a prompt-lookup draft token at depth j of a continuation
  found by an n-token match is accepted once its parent was (docs/spec.md §5's conditional
  acceptance rate, counted on the verified branch), and `rank` orders the continuations. Each
  (n, depth band) cell shrinks toward q, the rate pooled over all of them (a Beta(1, 1) prior:
  0.5), with CELL_PRIOR pseudo-trials, so a cell with few trials reads as q. One pooled q
  misprices a copy: measured on the long-prompt workload's greedy answers (rank-0 chains), a
  first token is accepted 27 / 42 / 61 % of the time after a 1 / 2 / 3-token match, but once
  three tokens of a copy are accepted the next is accepted about 92-97 % of the time. A pooled q
  then overprices a chain's first token and prices its tail at q^depth, so trees cut by cost
  (`--tree auto`) stopped where a copy had only begun;
- datastore (propose/rest.py: a corpus of the target's own earlier answers, REST's retrieval):
  up to `store_nodes` of the datastore's most frequent continuations of the context's longest
  matching suffix (n = store_max_ngram..store_min_ngram), in the same trie as prompt lookup's (a
  path both propose is one node, scored as prompt lookup's), scored
      logp(node) = log(min(1, r * share))
  where share is the fraction of the datastore's occurrences that continue with the node's path
  (REST's frequency, already a probability of the whole path) and r calibrates it: accepted
  datastore nodes / the sum of their shares over every datastore node the target could have
  accepted (a prior of 1 / 2, so r starts at 0.5). A store whose frequencies overpromise (an
  online store of a few loops, say) gets a small r, and the budget merge stops paying a tree
  slot for its nodes.
A node's entropy is the binary entropy of its source's estimate (the draft is deterministic;
this keeps the entropy router's scale). With no match the tree is the root alone: one step of
plain decoding. `prompt=False` drafts from the datastore alone.

An incremental index (n-gram -> positions that follow it) makes each proposal O(matches), not
O(sequence length). Verification is unchanged, so decoding stays lossless (docs/spec.md §3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from taps.core.config import TreeConfig
from taps.core.proposer import StepInfo
from taps.drafter.auto_tree import size_by_cost
from taps.propose.rest import Datastore
from taps.core.tree import DraftTree, TokenPaths, rerank
from taps.core.verify import Acceptance

DEPTH_BANDS = (1, 2, 3, 4, 8)  # a draft token's depth band: the largest of these <= its depth
CELL_PRIOR = 2.0  # pseudo-trials by which an (n, depth band) cell's rate leans to the pooled q


def depth_band(depth: int) -> int:
    return max(b for b in DEPTH_BANDS if b <= depth)


@dataclass(frozen=True)
class LookupSpec:
    """A lookup member: prompt lookup (n-gram sizes tried, longest first), a datastore, or both
    (prompt lookup and up to `store_nodes` of the datastore's nodes, the best scores kept)."""

    max_ngram: int = 3
    min_ngram: int = 1
    datastore: Datastore | None = None
    prompt: bool = True  # False: the datastore alone
    store_max_ngram: int = 16  # the longest suffix the store holds, up to its index depth (rest.INDEX_DEPTH says why)
    store_min_ngram: int = 1
    store_nodes: int | None = 8  # at most this many datastore nodes per tree (None: the tree's whole budget);
    # on MT-Bench 8 keep most of the acceptance (tau 2.03 vs 2.09 with 31 in a 32-node tree) at half the nodes


class LookupProposer:
    def __init__(self, tree: TreeConfig = TreeConfig(), spec: LookupSpec = LookupSpec(), drafter: int = 0,
                 max_matches: int = 512, memory=None, policy=None):
        """`memory`: what a server's earlier requests taught q and r (a propose/memory.LookupMemory):
        both start warm from it, and every judged node is remembered there too. `policy`: an
        AutoTree (drafter/auto_tree.py) whose measured costs size each tree (size_by_cost), for
        a lookup drafter verified alone under `--tree auto`; None fills the tree to its budget."""
        for lo, hi in ((spec.min_ngram, spec.max_ngram), (spec.store_min_ngram, spec.store_max_ngram)):
            if not 1 <= lo <= hi:
                raise ValueError(f"lookup n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, got {lo}, {hi}")
        if not spec.prompt and spec.datastore is None:
            raise ValueError("a lookup drafter without prompt lookup needs a datastore")
        self.tree = tree
        self.max_ngram, self.min_ngram = spec.max_ngram, spec.min_ngram
        self.drafter = drafter  # its index in a composition
        self.datastore, self.prompt = spec.datastore, spec.prompt
        self.store_ngram, self.max_matches = (spec.store_max_ngram, spec.store_min_ngram), max_matches
        self.store_nodes = spec.store_nodes  # at most this many datastore nodes per tree (None: the whole budget)
        self.accepted, self.tried = 1.0, 2.0  # prompt lookup's Beta(1, 1): q starts at 0.5
        self.store_accepted, self.store_promised = 1.0, 2.0  # the datastore's calibration: r starts at 0.5
        self.memory, self.policy = memory, policy
        if memory is not None:
            self.accepted, self.tried = memory.prompt.warm(self.accepted, self.tried)
            self.store_accepted, self.store_promised = memory.store.warm(self.store_accepted, self.store_promised)
        # (match n, depth band) -> [hits, trials] of prompt lookup's tokens (warm from memory when given)
        self.cells: dict[tuple[int, int], list[float]] = {}
        self._proposed: dict[tuple[int, ...], float | None] = {}  # last tree: token path -> share (None: prompt lookup)
        self._match_n: dict[tuple[int, ...], int] = {}  # last tree: prompt lookup's token path -> its match's n
        self._seq: list[int] = []
        self._follows: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions right after its occurrences
        self._device = torch.device("cpu")

    # ---- the sequence and its index ------------------------------------------------------------
    def _append(self, tokens: list[int]) -> None:
        for token in tokens:
            self._seq.append(token)
            end = len(self._seq)  # the n-grams ending here are followed by position `end`
            for n in range(1, min(self.max_ngram, end) + 1):
                self._follows.setdefault(tuple(self._seq[end - n:end]), []).append(end)

    @property
    def q(self) -> float:
        """Running estimate of P(a prompt-lookup draft token is accepted | its parent was)."""
        return self.accepted / self.tried

    def q_at(self, n: int, depth: int) -> float:
        """P(a prompt-lookup token at `depth` of a continuation found by an n-token match is
        accepted | its parent was): its cell's hits and trials, leaning to q by CELL_PRIOR."""
        hits, trials = self._cell((n, depth_band(depth)))
        return (hits + CELL_PRIOR * self.q) / (trials + CELL_PRIOR)

    def _cell(self, key: tuple[int, int]) -> list[float]:
        """[hits, trials] of one (n, depth band) cell, made on first use (warm from memory)."""
        if key not in self.cells:
            warm = self.memory.cell(key).warm(0.0, 0.0) if self.memory is not None else (0.0, 0.0)
            self.cells[key] = list(warm)
        return self.cells[key]

    @property
    def r(self) -> float:
        """Running calibration of the datastore's shares: P(a datastore node is accepted) = r * share."""
        return self.store_accepted / self.store_promised

    # ---- the Proposer protocol ---------------------------------------------------------------
    def start(self, features: Tensor, tokens: Tensor) -> None:
        self._seq, self._follows = [], {}
        self._device = tokens.device
        self._append(tokens.tolist())

    def advance(self, tokens: list[int]) -> None:
        """Extend the sequence without judging a tree: for a caller that replays a known answer
        token by token (serve/adapt_focus.py), where no tree was verified."""
        self._append(tokens)

    def continuations(self) -> list[list[int]]:
        """Up to top_k candidate continuations, best first (longest match, then most recent)."""
        return [cont for _, cont in self.matches()]

    def matches(self) -> list[tuple[int, list[int]]]:
        """(n, continuation) of each of continuations(): n is the length of the match it follows.

        A continuation that reaches the sequence's end goes on with the tokens it has just
        predicted: after an occurrence `period` tokens back, token j of the draft is
        seq[start + j % period]. That is what the target emits if it keeps copying, and it is what
        prompt lookup would propose one step later anyway; in a loop of p tokens it drafts to the
        full depth from the loop's first repeat, instead of p tokens (or the older, longer and
        lower-ranked occurrences) per step."""
        seq, depth, found, seen = self._seq, self.tree.depth, [], set()
        end = len(seq)
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            # the last occurrence is the suffix itself: nothing follows it yet
            for start in reversed(self._follows.get(tuple(seq[-n:]), [])[:-1]):
                period = seq[start:end]  # >= 1 token: the n-gram ends before the sequence does
                cont = tuple(period * -(-depth // len(period)))[:depth]  # seq[start + j mod len(period)]
                if cont not in seen:
                    seen.add(cont)
                    found.append((n, list(cont)))
                    if len(found) == self.tree.top_k:
                        return found
        return found

    def propose(self) -> DraftTree:
        if not self._seq:
            raise RuntimeError("propose() before start()")
        log_r = math.log(self.r)
        tokens, parents, logp, depth, entropy = [self._seq[-1]], [-1], [0.0], [0], [0.0]
        child: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        path: list[tuple[int, ...]] = [()]  # each node's token path below the root
        self._proposed, self._match_n = {}, {}
        budget = self.tree.total_tokens - 1

        def add(node: int, token: int, score: float, h: float, share: float | None) -> int:
            """The child of `node` for `token` (made if new)."""
            if (node, token) in child:
                return child[(node, token)]
            tokens.append(token)
            parents.append(node)
            depth.append(depth[node] + 1)
            logp.append(score)
            entropy.append(h)
            path.append(path[node] + (token,))
            self._proposed[path[-1]] = share
            child[(node, token)] = len(tokens) - 1
            return len(tokens) - 1

        h_q = _binary_entropy(self.q)
        log_q: dict[tuple[int, int], float] = {}  # (n, depth) -> log q(n, depth), this step
        for rank, (n, cont) in enumerate(self.matches() if self.prompt else []):
            node, score = 0, -math.log(rank + 1)
            for j, token in enumerate(cont, 1):
                if (n, j) not in log_q:
                    log_q[(n, j)] = math.log(self.q_at(n, j))
                score += log_q[(n, j)]
                node = add(node, token, score, h_q, None)
                self._match_n.setdefault(path[node], n)
        if self.datastore is not None:
            placed: list[int | None] = []  # the tree node of each datastore node (None: left out)
            fresh, cap = 0, budget if self.store_nodes is None else min(budget, self.store_nodes)
            for found in self.datastore.draft(self._seq, budget, self.tree.depth, *self.store_ngram,
                                              max_matches=self.max_matches):
                up = 0 if found.parent < 0 else placed[found.parent]
                new = up is not None and (up, found.token) not in child
                if up is None or (new and fresh == cap):  # most frequent first: the rest is left out
                    placed.append(None)
                    continue
                fresh += new  # nodes prompt lookup also proposed do not count against the cap
                score = min(0.0, log_r + math.log(found.share))  # log(min(1, r * share))
                placed.append(add(up, found.token, score, _binary_entropy(math.exp(score)), found.share))
        drafted = DraftTree.drafted(
            tokens=torch.tensor(tokens, dtype=torch.long, device=self._device),
            parents=torch.tensor(parents, dtype=torch.long, device=self._device),
            logp=torch.tensor(logp, device=self._device),
            entropy=torch.tensor(entropy, device=self._device),
            drafter=self.drafter,
        )
        best = rerank(drafted, budget + 1)  # the best `budget` nodes of both sources, by their estimates
        if self.policy is None:
            return best
        self.policy.context = len(self._seq)  # the verify cost it weighs is the one at this context
        return size_by_cost(best, self.policy)

    def observe(self, tree: DraftTree, acceptance: Acceptance, features: Tensor) -> None:
        """Score this proposer's tree against the tokens the target emitted (whichever tree was
        verified: alone, routed or merged), each node by its source, then extend the sequence and
        its index."""
        emitted = acceptance.new_tokens  # accepted draft tokens, then the bonus: the target's own tokens
        if tree.size > 1:
            self._score(tree, emitted)
        self._append(emitted)

    def _score(self, tree: DraftTree, emitted: list[int]) -> None:
        """Prompt lookup: at every state the target reached where prompt lookup offered children,
        one tried, and one accepted if the target's next token is among them. The
        datastore: every datastore node of `tree` (as the decoder kept it) promised its share, and
        the ones on the emitted path were accepted (a node that continues the whole emitted path,
        deeper than the target went, is left unjudged). A tree this proposer did not draft (a path it
        never proposed) counts as prompt lookup's, as before the split."""
        paths = TokenPaths(tree)
        states = paths.follow(emitted)
        matched = len(states) - 1
        source = self._proposed.get
        for i in range(min(matched + 1, len(emitted))):  # every state the target reached, and its next token
            stem = tuple(emitted[:i])
            offered = [token for token in paths.options(states[i]) if source(stem + (token,), None) is None]
            if offered:
                hit = emitted[i] in offered
                self.tried += 1
                self.accepted += hit
                if self.memory is not None:
                    self.memory.prompt.add(hit, 1)
                # its cell: the longest match among the offered tokens' (none: a path this
                # proposer did not draft, which counts for q alone)
                n = max((self._match_n.get(stem + (token,), 0) for token in offered), default=0)
                if n:
                    key = (n, depth_band(i + 1))
                    cell = self._cell(key)
                    cell[0] += hit
                    cell[1] += 1
                    if self.memory is not None:
                        self.memory.cell(key).add(hit, 1)
        if self.datastore is None:
            return
        node_tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        node_path: list[tuple[int, ...]] = [()]
        for i in range(1, tree.size):  # parents precede children
            node_path.append(node_path[parents[i]] + (node_tokens[i],))
        accepted_prefixes = {tuple(emitted[:i]) for i in range(1, matched + 1)}
        known = tuple(emitted)
        for p in set(node_path[1:]):
            share = source(p)
            if share is None or (len(p) > len(known) and p[:len(known)] == known):
                continue  # prompt lookup's, or past what the target emitted along its own path: not yet judged
            hit = p in accepted_prefixes
            self.store_promised += share
            self.store_accepted += hit
            if self.memory is not None:
                self.memory.store.add(hit, share)

    @property
    def context_length(self) -> int:
        """Tokens of the context so far, the pending one included (the context a step's verify
        cost is priced at: a budget merge's heads read it when they did not draft themselves)."""
        return len(self._seq)

    def step_info(self) -> StepInfo:
        """With a policy: the tree tokens it chose for the last tree."""
        if self.policy is None or not self.policy.chosen:
            return StepInfo()
        return StepInfo(tree_tokens=self.policy.chosen[-1][1])


def _binary_entropy(p: float) -> float:
    p = min(max(p, 1e-12), 1 - 1e-12)
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))
