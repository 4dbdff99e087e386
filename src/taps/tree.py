"""DraftTree: the one data structure passed from a proposer to the target and the verifier.

A tree is a parents array. Node 0 is the root: the last committed token, which the target has
not yet seen (it was sampled by the previous verification). Every other node is a draft token
whose parent precedes it (parents[i] < i), so a single left-to-right pass over the nodes visits
ancestors before descendants. Everything else (depths, ancestor mask, paths, positions) derives
from the parents array and is computed, never stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class DraftTree:
    tokens: Tensor  # [N] long, tokens[0] = root token
    parents: Tensor  # [N] long, -1 for the root, parents[i] < i otherwise
    logp: Tensor  # [N] float, cumulative draft log-prob along the path (0 at the root)
    entropy: Tensor  # [N] float, entropy of the draft distribution that proposed the node (0 at the root)
    source: Tensor  # [N] long, index of the drafter that proposed the node (-1 at the root)

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        for name in ("parents", "logp", "entropy", "source"):
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
    def root_only(cls, token: int, device: torch.device | str = "cpu") -> "DraftTree":
        """A tree with no draft nodes: verifying it is one step of plain decoding."""
        return cls(
            tokens=torch.tensor([token], dtype=torch.long, device=device),
            parents=torch.tensor([-1], dtype=torch.long, device=device),
            logp=torch.zeros(1, device=device),
            entropy=torch.zeros(1, device=device),
            source=torch.full((1,), -1, dtype=torch.long, device=device),
        )

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

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
        keep = (depth <= max_depth).nonzero().squeeze(-1)
        if keep.numel() == self.size:
            return self
        remap = torch.full((self.size,), -1, dtype=torch.long, device=self.parents.device)
        remap[keep] = torch.arange(keep.numel(), device=self.parents.device)
        old_parents = self.parents[keep]
        new_parents = torch.where(old_parents >= 0, remap[old_parents.clamp(min=0)], old_parents)
        return DraftTree(
            tokens=self.tokens[keep],
            parents=new_parents,
            logp=self.logp[keep],
            entropy=self.entropy[keep],
            source=self.source[keep],
        )


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
