"""The head's view of the committed context: its own KV cache, the pending root, and the feature
it predicts for the root's position.

The head consumes (feature_t, token_{t+1}) pairs at position t. After it has consumed every
pair of the committed context, its last output predicts the target feature at the pending root
token's position, whose LM-head distribution proposes the root's children.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from taps.core import kv
from taps.drafter.head import DraftHead
from taps.core.tree import additive_mask


@dataclass
class HeadContext:
    cache: object  # DynamicCache of the head: one row per consumed pair
    length: int  # pairs consumed = position of the next pair
    root_token: int  # pending token: the root of the next tree
    root_hidden: Tensor  # [H] head output at the last consumed pair


def causal_block_mask(new: int, past: int, dtype: torch.dtype, device) -> Tensor:
    """Additive [1, 1, new, past + new] mask: a causal block appended after `past` visible rows."""
    chain = torch.ones(new, new, dtype=torch.bool, device=device).tril()
    return additive_mask(chain, torch.arange(new, device=device), past, None, dtype)


@torch.inference_mode()
def consume(head: DraftHead, ctx: HeadContext | None, next_tokens: Tensor, features: Tensor) -> HeadContext:
    """Feed pairs (features[i], next_tokens[i]) to the head, after the pairs already in `ctx`.

    next_tokens: [T] long, the token that follows each feature's position; the last one becomes
    the new root. features: [T, F] true target features as the Target returns them (the head
    takes its own layers out of them: DraftHead.select_features).
    """
    features = head.select_features(features)  # [T, H], or [T, 3H] for an EAGLE-3 head
    if ctx is None:
        ctx = HeadContext(cache=kv.new_cache(), length=0, root_token=-1, root_hidden=features[-1])
    t = int(next_tokens.shape[0])
    device = features.device
    positions = torch.arange(ctx.length, ctx.length + t, device=device)[None]  # [1, T]
    mask = causal_block_mask(t, ctx.length, features.dtype, device)
    hidden = head(next_tokens.to(device)[None], features[None], positions, mask, ctx.cache)[0]  # [T, H]
    return HeadContext(cache=ctx.cache, length=ctx.length + t, root_token=int(next_tokens[-1]), root_hidden=hidden[-1])
