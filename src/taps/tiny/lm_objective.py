"""The tiny target's training objective: next-token cross-entropy, optionally plus token-level
unlikelihood (Welleck et al., 2019, "Neural Text Generation with Unlikelihood Training").

Why: a small LM trained by cross-entropy alone falls into a repeated phrase under greedy decoding
(measured on every tiny target so far). Unlikelihood lowers, at every position, the probability
of tokens that already occurred earlier in the block and are not the true next token, which is
what greedy loops feed on; with weight 0 the objective is plain cross-entropy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def previous_token_candidates(targets: torch.Tensor) -> torch.Tensor:
    """Negative candidates of each position: the distinct targets of earlier positions of the same
    row, except the position's own target, as a mask over those earlier positions (each token
    counted once, at its first occurrence). targets [B, T] -> bool [B, T, T], [b, i, j]: is j one."""
    t = targets.shape[1]
    earlier = torch.ones(t, t, dtype=torch.bool, device=targets.device).tril(-1)  # [T, T]: j < i
    same = targets.unsqueeze(2) == targets.unsqueeze(1)  # [B, T, T]: targets[b, i] == targets[b, j]
    first = ~(same & earlier).any(dim=2)  # [B, T]: the token at j does not occur before j
    return earlier & first.unsqueeze(1) & ~same


def lm_loss(logits: torch.Tensor, input_ids: torch.Tensor, unlikelihood: float = 0.0) -> tuple[torch.Tensor, dict]:
    """Mean next-token loss of packed blocks. logits [B, T, V], input_ids [B, T] -> (loss, parts),
    parts = {"ce": float, "unlikelihood": float} (the latter when its weight is > 0). The
    unlikelihood term gathers the candidates' log-probabilities ([B, T, T]) rather than masking the
    whole vocabulary ([B, T, V]), which keeps its cost small next to the softmax."""
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)  # [B, T-1, V]
    targets = input_ids[:, 1:]  # [B, T-1]
    ce = F.nll_loss(logp.flatten(0, 1), targets.flatten())
    if unlikelihood <= 0:
        return ce, {"ce": float(ce.detach())}
    b, t = targets.shape
    logp_earlier = logp.gather(2, targets.unsqueeze(1).expand(b, t, t))  # [B, T, T]: log p_i(targets[j])
    one_minus_p = (1.0 - logp_earlier.exp()).clamp_min(1e-5)
    ul = -(torch.log(one_minus_p) * previous_token_candidates(targets)).sum() / targets.numel()
    return ce + unlikelihood * ul, {"ce": float(ce.detach()), "unlikelihood": float(ul.detach())}
