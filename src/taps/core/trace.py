"""What the study needs to know about one verification step, beyond the accepted length (docs/spec.md §5).

The decode loop calls `step_trace` only when asked (DecodeConfig.trace): it reads the tree and
the target's logits and changes nothing, so decoding is the same with or without it. Its cost
is kept out of the decoder's timings.

Terms: the *accepted path* is the root plus the accepted nodes; every other draft node is
*rejected*. Draft confidence c(v) = exp(cumulative log-prob) and draft entropy are the head's
(docs/spec.md §2). Verifier entropy is the entropy of softmax(target logits) at temperature 1 at a node:
at the root and every accepted node but the last, a draft token was accepted there; at the last
accepted node every child (if it has any) was rejected — the first rejected position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from taps.core.tree import DraftTree
from taps.core.verify import Acceptance


@dataclass(frozen=True)
class StepTrace:
    accepted_confidence: list[float]  # [A] c(v) of the accepted nodes, root excluded, path order
    accepted_entropy: list[float]  # [A] draft entropy of the accepted nodes
    rejected_confidence: list[float]  # [N-1-A] c(v) of every other draft node
    rejected_entropy: list[float]  # [N-1-A] their draft entropy
    verifier_entropy_accepted: list[float]  # [A] target entropy where a draft token was accepted
    verifier_entropy_rejected: float | None  # target entropy where every draft child was rejected; None at a leaf


def entropy_of(logp: Tensor) -> Tensor:  # [..., V] log-probs -> [...] nats
    """The package's one entropy (docs/spec.md §2), of draft distributions (drafter/expand.py) and of
    the target's (here): -sum p log p over log-probabilities; a token of probability 0 (logp -inf,
    as a filtered or reduced distribution has) contributes 0, not NaN."""
    finite = logp.clamp(min=torch.finfo(logp.dtype).min)
    return -(logp.exp() * finite).sum(-1)


def step_trace(tree: DraftTree, acceptance: Acceptance, logits: Tensor) -> StepTrace:
    """tree: the verified tree (N nodes); logits: [N, V] the target's logits at its nodes."""
    return path_trace(tree, acceptance, logits[acceptance.nodes])


def path_trace(tree: DraftTree, acceptance: Acceptance, path_logits: Tensor) -> StepTrace:
    """step_trace from the target's logits on the accepted path only ([A+1, V], root first): all it
    reads of the target, and all that a replayed step (core/replay.py) has."""
    path = acceptance.nodes  # [A+1] root first
    on_path = torch.zeros(tree.size, dtype=torch.bool, device=tree.tokens.device)
    on_path[path] = True
    on_path[0] = True
    others = (~on_path).nonzero().flatten()  # [N-1-A]
    confidence, draft_entropy = tree.confidence.float(), tree.entropy.float()
    verifier = entropy_of(torch.log_softmax(path_logits.float(), dim=-1))  # [A+1], in float32
    last = int(path[-1])
    has_children = bool((tree.parents == last).any())
    return StepTrace(
        accepted_confidence=confidence[path[1:]].tolist(),
        accepted_entropy=draft_entropy[path[1:]].tolist(),
        rejected_confidence=confidence[others].tolist(),
        rejected_entropy=draft_entropy[others].tolist(),
        verifier_entropy_accepted=verifier[:-1].tolist(),
        verifier_entropy_rejected=float(verifier[-1]) if has_children else None,
    )
