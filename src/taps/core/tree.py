"""DraftTree: the one data structure passed from a proposer to the target and the verifier.

A tree is a parents array. Node 0 is the root: the last committed token, which the target has
not yet seen (it was sampled by the previous verification). Every other node is a draft token
whose parent precedes it (parents[i] < i), so a single left-to-right pass over the nodes visits
ancestors before descendants. Everything else (depths, ancestor mask, paths, positions) derives
from the parents array and is computed, never stored.

Provenance is one required bitmask per node, `drafters` (bit h: drafter h proposed it); a step
is credited to the lowest-numbered drafter of its deepest accepted node (`credited`), and the
records keep the whole bitmask beside it. A composition's tree also carries its members' own
trees (`parts`), which the decoder hands back to the composition's observe().
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class DraftTree:
    tokens: Tensor  # [N] long, tokens[0] = root token
    parents: Tensor  # [N] long, -1 for the root, parents[i] < i otherwise
    logp: Tensor  # [N] float, cumulative draft log-prob along the path (0 at the root)
    entropy: Tensor  # [N] float, entropy of the draft distribution that proposed the node (0 at the root)
    drafters: Tensor  # [N] long bitmask of every drafter that proposed the node (bit h = drafter h; 0 at the root)
    # the member trees a composition drafted this step, in member order (None: a member that did
    # not draft), handed back to each member's observe(); () for a drafter's own tree
    parts: tuple = ()

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        for name in ("parents", "logp", "entropy", "drafters"):
            if getattr(self, name).shape != (n,):
                raise ValueError(f"DraftTree.{name} has shape {tuple(getattr(self, name).shape)}, expected ({n},)")
        if n == 0 or int(self.parents[0]) != -1:
            raise ValueError("DraftTree node 0 must be the root (parents[0] == -1)")
        if n > 1:
            idx = torch.arange(1, n, device=self.parents.device)
            rest = self.parents[1:]
            if bool(((rest < 0) | (rest >= idx)).any()):
                raise ValueError("DraftTree parents must satisfy 0 <= parents[i] < i for every non-root node")

    # ----------------------------------------------------------------------------------------
    @classmethod
    def drafted(cls, tokens: Tensor, parents: Tensor, logp: Tensor, entropy: Tensor, drafter: int) -> "DraftTree":
        """One drafter's tree: every node below the root proposed by `drafter` (-1: none, a root-only tree)."""
        per_node = torch.full_like(parents, drafter)
        per_node[0] = -1
        return cls(tokens=tokens, parents=parents, logp=logp, entropy=entropy, drafters=drafter_bits(per_node))

    @classmethod
    def root_only(cls, token: int, device: torch.device | str = "cpu") -> "DraftTree":
        """A tree with no draft nodes: verifying it is one step of plain decoding."""
        return cls.drafted(tokens=torch.tensor([token], dtype=torch.long, device=device),
                           parents=torch.tensor([-1], dtype=torch.long, device=device),
                           logp=torch.zeros(1, device=device), entropy=torch.zeros(1, device=device), drafter=-1)

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def credited(self, node: int) -> int:
        """The drafter a step ending at `node` is credited to: the lowest-numbered one that proposed
        it (-1 at the root). Of a trie merge's shared node, every proposer is in `drafters`."""
        mask = int(self.drafters[node])
        return (mask & -mask).bit_length() - 1

    def drafter_sets(self) -> list[list[int]]:
        """For each node, the indices of every drafter that proposed it (empty at the root)."""
        return [[h for h in range(mask.bit_length()) if mask >> h & 1] for mask in self.drafters.tolist()]

    @property
    def confidence(self) -> Tensor:  # [N] product of draft probabilities along the path (1 at the root)
        return self.logp.exp()

    def depth(self) -> Tensor:  # [N] long, 0 at the root
        depth = torch.zeros_like(self.parents)
        parent = self.parents.clamp(min=0)
        is_child = self.parents >= 0
        # depth[i] = depth[parent[i]] + 1; converges after (max depth) sweeps.
        for _ in range(self.size):
            new = torch.where(is_child, depth[parent] + 1, depth)
            if torch.equal(new, depth):
                break
            depth = new
        return depth

    def ancestor_mask(self) -> Tensor:  # [N, N] bool, [i, j] = j is i or an ancestor of i
        n = self.size
        device = self.parents.device
        rows = torch.arange(1, n, device=device)
        # Doubling: after k sweeps every ancestor within 2^k levels is marked.
        step = torch.zeros(n, n, dtype=torch.bool, device=device)
        step[rows, self.parents[1:]] = True
        step |= torch.eye(n, dtype=torch.bool, device=device)
        reach = step
        while True:
            nxt = (reach.float() @ reach.float()) > 0
            if torch.equal(nxt, reach):
                break
            reach = nxt
        return reach

    def children(self) -> list[list[int]]:
        """children[i] = node ids whose parent is i, in node order (= draft-score order for EAGLE-2)."""
        kids: list[list[int]] = [[] for _ in range(self.size)]
        for child, parent in enumerate(self.parents.tolist()):
            if parent >= 0:
                kids[parent].append(child)
        return kids

    def path_to(self, node: int) -> list[int]:
        """Node ids from the root to `node`, root first."""
        parents = self.parents.tolist()
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        return path[::-1]

    def paths(self) -> Tensor:  # [L, D+1] long, root-to-leaf node ids, -1 padded, one row per leaf
        parents = self.parents.tolist()
        is_parent = set(p for p in parents if p >= 0)
        leaves = [i for i in range(self.size) if i not in is_parent]
        rows = [self.path_to(leaf) for leaf in leaves]
        width = max(len(r) for r in rows)
        out = torch.full((len(rows), width), -1, dtype=torch.long)
        for i, row in enumerate(rows):
            out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        return out.to(self.parents.device)

    def prune_depth(self, max_depth: int) -> "DraftTree":
        """Keep only nodes with depth <= max_depth (used near max_new_tokens / the context end)."""
        depth = self.depth()
        keep = (depth <= max_depth).nonzero().squeeze(-1)  # sorted; a node's parent is shallower, so kept too
        if keep.numel() == self.size:
            return self
        return keep_nodes(self, keep)


def additive_mask(
    ancestors: Tensor, depth: Tensor | None, prefix: int, window: int | None, dtype: torch.dtype
) -> Tensor:
    """Additive mask [1, 1, Q, prefix + K]: query i sees the `prefix` committed rows and the rows j
    with ancestors[i, j] (its own ancestors and itself).

    ancestors: [Q, K] bool, depth: [Q] long (only needed with a window; then Q == K and the rows
    are the tree nodes). With a sliding window W a query at position q only sees keys at positions
    k with q - k < W (the library's own convention).
    """
    q = ancestors.shape[0]
    device = ancestors.device
    visible = torch.cat([torch.ones(q, prefix, dtype=torch.bool, device=device), ancestors], dim=1)
    if window is not None:
        if depth is None:
            raise ValueError("a sliding-window mask needs node depths")
        q_pos = prefix + depth  # [Q]
        k_pos = torch.cat([torch.arange(prefix, device=device), prefix + depth])  # [prefix + K]
        visible &= (q_pos[:, None] - k_pos[None, :]) < window
    mask = torch.zeros(visible.shape, dtype=dtype, device=device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]


class TokenPaths:
    """A tree walked by token path: the verifier's walk (verify.py) and every proposer's mapping
    of what the target emitted back onto its own tree (which may have been trimmed, merged or not
    verified at all, so node ids do not carry over). Nodes that spell the same tokens from the root
    (one proposal from several drafters of a merged tree) are one *state* and their children are
    pooled, so each distinct token is one option."""

    def __init__(self, tree: "DraftTree"):
        self.kids, self.tokens, self.logp = tree.children(), tree.tokens.tolist(), tree.logp.tolist()

    def options(self, state: Sequence[int]) -> dict[int, list[int]]:
        """token -> the children of `state` carrying it (in node order), the tokens best draft score
        first (ties: the lower node)."""
        pooled = sorted((c for node in state for c in self.kids[node]), key=lambda c: (-self.logp[c], c))
        by_token: dict[int, list[int]] = {}
        for child in pooled:
            by_token.setdefault(self.tokens[child], []).append(child)
        return {token: sorted(nodes) for token, nodes in by_token.items()}

    def follow(self, tokens: Sequence[int]) -> list[list[int]]:
        """The states along `tokens` from the root ([0] first), as far as the tree holds them:
        len(result) - 1 tokens matched."""
        states = [[0]]
        for token in tokens:
            nodes = self.options(states[-1]).get(token)
            if not nodes:
                break
            states.append(nodes)
        return states


def drafter_bits(drafter: Tensor) -> Tensor:
    """[N] long bitmask of one drafter per node: bit drafter[i] (0 where drafter is -1, the root)."""
    return torch.where(drafter >= 0, 1 << drafter.clamp(min=0), torch.zeros_like(drafter))


# ---- merging the trees of several drafters (docs/spec.md §4, merges) ----
# Input: one tree per drafter, all rooted at the same pending token; tree h's draft nodes are
# attributed to drafter h (whatever their own `drafters` say). Output: one DraftTree whose nodes
# keep the parents-before-children order, with `drafters` = the bitmask of every drafter that
# proposed it. Positions are depths, so every merged node sits
# at the same position as in the tree it came from.
MAX_MERGED_TREES = 62  # drafters is an int64 bitmask


def _merge_inputs(trees: Sequence[DraftTree]) -> int:
    """Checks the trees can share a root; returns the root token."""
    if not trees:
        raise ValueError("merging needs at least one tree")
    if len(trees) > MAX_MERGED_TREES:
        raise ValueError(f"at most {MAX_MERGED_TREES} trees can be merged, got {len(trees)}")
    root = int(trees[0].tokens[0])
    for h, tree in enumerate(trees):
        if int(tree.tokens[0]) != root:
            raise ValueError(f"tree {h} is rooted at token {int(tree.tokens[0])}, tree 0 at {root}: "
                             "merged trees must share the pending root token")
    return root


def merge_disjoint(trees: Sequence[DraftTree]) -> DraftTree:
    """The paper's merge: [root | tree 0's nodes | tree 1's nodes | ...] under one shared root.

    Every node keeps its own tree's parent, so it attends to the root and its own ancestors only
    (no cross-tree attention); the verifier sees 1 + sum(size - 1) tokens. Identical proposals
    stay separate nodes; verification tries each distinct token once anyway (verify.py pools them).
    """
    _merge_inputs(trees)
    first = trees[0]
    tokens, parents, logp, entropy, drafters = [first.tokens[:1]], [first.parents[:1]], [first.logp[:1]], \
        [first.entropy[:1]], [torch.zeros(1, dtype=torch.long, device=first.tokens.device)]
    offset = 0  # merged id of tree node j (j >= 1) is offset + j
    for h, tree in enumerate(trees):
        par = tree.parents[1:]  # [n_h]
        tokens.append(tree.tokens[1:])
        parents.append(torch.where(par == 0, par, par + offset))
        logp.append(tree.logp[1:].to(first.logp.dtype))
        entropy.append(tree.entropy[1:].to(first.entropy.dtype))
        drafters.append(torch.full_like(par, 1 << h))
        offset += tree.size - 1
    return DraftTree(tokens=torch.cat(tokens), parents=torch.cat(parents), logp=torch.cat(logp),
                     entropy=torch.cat(entropy), drafters=torch.cat(drafters))


def merge_trie(trees: Sequence[DraftTree]) -> DraftTree:
    """Union of the trees as a prefix tree: nodes with the same token sequence from the root are
    one node, so no two siblings carry the same token and identical proposals cost one verifier
    slot. Nodes appear in first-seen order (tree 0's nodes in its order, then tree 1's new ones, ...),
    so the trie of one tree, or of identical trees, is that tree.

    A shared node takes logp (hence confidence) and entropy from the drafter that scored it highest
    (the first on ties); `drafters` records every drafter that proposed it. With each
    input's scores non-increasing along paths, so are the merged ones (max over drafters of
    non-increasing sequences).
    """
    root = _merge_inputs(trees)
    device, fdtype = trees[0].tokens.device, trees[0].logp.dtype
    node_of: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
    tokens, parents, logp, entropy, mask = [root], [-1], [0.0], [0.0], [0]
    for h, tree in enumerate(trees):
        t_tok, t_par = tree.tokens.tolist(), tree.parents.tolist()
        t_logp, t_ent = tree.logp.tolist(), tree.entropy.tolist()
        merged = [0] * tree.size  # tree node -> merged node
        for j in range(1, tree.size):
            key = (merged[t_par[j]], t_tok[j])
            m = node_of.get(key)
            if m is None:
                m = node_of[key] = len(tokens)
                tokens.append(t_tok[j])
                parents.append(key[0])
                logp.append(t_logp[j])
                entropy.append(t_ent[j])
                mask.append(1 << h)
            else:
                mask[m] |= 1 << h
                if t_logp[j] > logp[m]:
                    logp[m], entropy[m] = t_logp[j], t_ent[j]
            merged[j] = m
    long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    return DraftTree(tokens=long(tokens), parents=long(parents), logp=torch.tensor(logp, dtype=fdtype, device=device),
                     entropy=torch.tensor(entropy, dtype=trees[0].entropy.dtype, device=device),
                     drafters=long(mask))


def keep_nodes(tree: DraftTree, keep: Tensor) -> DraftTree:
    """The subtree of the nodes `keep` ([M] long, sorted, containing 0 and every kept node's parent)."""
    remap = torch.full((tree.size,), -1, dtype=torch.long, device=tree.parents.device)
    remap[keep] = torch.arange(keep.numel(), device=tree.parents.device)
    old_parents = tree.parents[keep]
    new_parents = torch.where(old_parents >= 0, remap[old_parents.clamp(min=0)], old_parents)
    if bool((new_parents[1:] < 0).any()):
        raise ValueError("keep_nodes: a kept node's parent was not kept")
    return DraftTree(tokens=tree.tokens[keep], parents=new_parents, logp=tree.logp[keep],
                     entropy=tree.entropy[keep], drafters=tree.drafters[keep])


def path_scores(tree: DraftTree) -> list[float]:
    """Each node's rank score: the lowest logp on its path from the root (its own logp whenever
    scores do not increase along paths). Parents precede children, so one pass suffices."""
    score, parents = tree.logp.tolist(), tree.parents.tolist()
    for i in range(1, tree.size):
        score[i] = min(score[i], score[parents[i]])
    return score


def rerank(tree: DraftTree, total_tokens: int) -> DraftTree:
    """Keep the root and the total_tokens - 1 most confident nodes (docs/spec.md §2 step 3, applied to any
    tree). A node's rank score is the lowest logp on its path, which is its own logp whenever
    scores do not increase along paths (always, for EAGLE-2 trees and their merges); ties keep the
    earlier node, so the kept set always contains each kept node's parent."""
    if total_tokens < 1:
        raise ValueError(f"total_tokens must be >= 1, got {total_tokens}")
    if tree.size <= total_tokens:
        return tree
    score = path_scores(tree)
    order = torch.sort(torch.tensor(score[1:], dtype=torch.float64), descending=True, stable=True).indices + 1
    order = order.to(tree.parents.device)
    keep = torch.cat([torch.zeros(1, dtype=torch.long, device=order.device), order[: total_tokens - 1].sort().values])
    return keep_nodes(tree, keep)


def merge_budget(trees: Sequence[DraftTree], total_tokens: int) -> DraftTree:
    """The union of every drafter's candidates, deduplicated as in merge_trie, reranked by
    confidence into one tree of at most `total_tokens` nodes (root included): verification costs
    no more than one drafter's tree."""
    return rerank(merge_trie(trees), total_tokens)
