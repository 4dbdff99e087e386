"""EAGLE-2 dynamic tree expansion (docs/spec.md §2), one head, from its HeadContext.

1. The head's distribution at the root gives the top-k level-1 candidates (score = log-prob).
2. For levels 2..depth: the current k beams run through the head at once (each attends to the
   context and its own ancestors), each beam proposes its top-k children scored by cumulative
   log-prob, and the global top-k of those become the next beams.
3. Rerank: of all candidates, keep the total_tokens - 1 with the highest cumulative log-prob.
   Candidates are created parents-first and scores never increase along a path, so a stable
   sort keeps every kept node's parent; restoring creation order puts parents before children.
A chain is the same code with top_k = 1. The head's distribution is always at temperature 1.
With a draft vocabulary (drafter/head.py) the head's distribution is over its N draft tokens:
top-k picks draft indices, mapped at once to target ids (the head consumes target ids and the
DraftTree holds only target ids), and scores, confidences and entropies are those of that
N-way distribution. Verification is unchanged and stays lossless whatever the draft distribution.
With a cost-aware `policy` (drafter/auto_tree.py), cfg's depth and total_tokens are caps: the
policy stops drafting after any level and chooses how many of the best nodes to keep.
The head's cache is returned to the context length afterwards: tree rows are scratch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from taps.core import kv
from taps.core.config import TreeConfig
from taps.drafter.context import HeadContext
from taps.drafter.head import EagleHead
from taps.core.trace import entropy_of
from taps.core.tree import DraftTree, additive_mask


@torch.inference_mode()
def expand_tree(head: EagleHead, ctx: HeadContext, cfg: TreeConfig, drafter: int = 0, policy=None) -> DraftTree:
    device = ctx.root_hidden.device
    root_logp = torch.log_softmax(head.logits(ctx.root_hidden).float(), dim=-1)  # [V] (or [N] draft vocabulary)
    k = min(cfg.top_k, root_logp.shape[-1])
    top_logp, top_idx = root_logp.topk(k)  # [k], [k]
    top_tok = head.to_target_ids(top_idx)  # [k] target ids

    # Candidate table, grown level by level (candidate ids are positions in the concatenation).
    cand_tok = [top_tok]
    cand_parent = [torch.full((k,), -1, dtype=torch.long, device=device)]
    cand_score = [top_logp]
    cand_entropy = [entropy_of(root_logp).expand(k)]
    n_cand = k

    beam_id = torch.arange(k, device=device)  # candidate ids of the current beams
    beam_tok, beam_score = top_tok, top_logp  # [k], [k]
    beam_feat = ctx.root_hidden.expand(k, -1)  # [k, H] input feature: the parent's predicted feature
    beam_anc = torch.zeros(k, 0, dtype=torch.bool, device=device)  # [k, processed] ancestors among tree rows

    levels = 1
    for level in range(2, cfg.depth + 1):
        if policy is not None and not policy.go_deeper(torch.cat(cand_score), beam_score, levels):
            break
        levels = level
        processed = beam_anc.shape[1]
        anc = torch.cat([beam_anc, torch.eye(k, dtype=torch.bool, device=device)], dim=1)  # [k, processed + k]
        mask = additive_mask(anc, None, ctx.length, None, beam_feat.dtype)  # context + own ancestors
        positions = torch.full((1, k), ctx.length + level - 2, dtype=torch.long, device=device)
        hidden = head(beam_tok[None], beam_feat[None], positions, mask, ctx.cache)[0]  # [k, H]
        logp = torch.log_softmax(head.logits(hidden).float(), dim=-1)  # [k, V] (or [k, N])
        child_logp, child_idx = logp.topk(k, dim=-1)  # [k, k]
        child_tok = head.to_target_ids(child_idx)  # [k, k] target ids
        cum = (beam_score[:, None] + child_logp).flatten()  # [k*k]

        cand_tok.append(child_tok.flatten())
        cand_parent.append(beam_id.repeat_interleave(k))
        cand_score.append(cum)
        cand_entropy.append(entropy_of(logp).repeat_interleave(k))

        best = cum.topk(k).indices  # [k] next beams, indices into this level
        parent_beam = best // k
        beam_id = n_cand + best
        beam_tok, beam_score = child_tok.flatten()[best], cum[best]
        beam_feat = hidden[parent_beam]
        beam_anc = anc[parent_beam]
        n_cand += k * k

    kv.truncate(ctx.cache, ctx.length)

    tokens, parents = torch.cat(cand_tok), torch.cat(cand_parent)
    scores, entropies = torch.cat(cand_score), torch.cat(cand_entropy)
    order = torch.sort(scores, descending=True, stable=True).indices
    total = cfg.total_tokens if policy is None else policy.tree_tokens(scores, levels, cfg.total_tokens)
    keep = order[: total - 1].sort().values  # creation order: parents first
    node_of = torch.full((n_cand,), -1, dtype=torch.long, device=device)
    node_of[keep] = torch.arange(1, keep.numel() + 1, device=device)
    kept_parents = parents[keep]
    node_parents = torch.where(kept_parents < 0, 0, node_of[kept_parents.clamp(min=0)])

    long = lambda *xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    return DraftTree.drafted(
        tokens=torch.cat([long(ctx.root_token), tokens[keep]]),
        parents=torch.cat([long(-1), node_parents]),
        logp=torch.cat([torch.zeros(1, device=device), scores[keep]]),
        entropy=torch.cat([torch.zeros(1, device=device), entropies[keep]]),
        drafter=drafter,
    )
