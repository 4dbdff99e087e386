"""A closed-form EAGLE head for tests and benchmarks on random targets (never for real use).

Training a head takes minutes; tests and benchmarks of composition need heads that are accepted
sometimes, and that differ like specialists do. `fit_linear_head` gets one in milliseconds: fc is
the ridge-regression map from [embed(token_{t+1}); feature_t] to feature_{t+1} on sequences the
caller supplies (e.g. the target's own greedy continuations of some prompts), and the decoder
layer's attention and MLP outputs are zeroed, so the head computes exactly fc. Two heads fitted
on different sequences are two "specialists" of one target.
"""

from __future__ import annotations

import torch
from torch import Tensor

from taps.drafter.checkpoint import init_head
from taps.drafter.head import EagleHead


@torch.no_grad()
def fit_linear_head(target, sequences: Tensor, ridge: float = 1e-3, seed: int = 0) -> EagleHead:
    """sequences: [B, T] long token ids (teacher forcing through `target`, a taps Target).
    Returns a head bound to the target, on its device and dtype."""
    ids = sequences.to(target.device, torch.long)
    feats = target.encode(ids).double()  # [B, T, H]
    embed = target.embed_tokens(ids[:, 1:]).double()  # [B, T-1, H]
    x = torch.cat([embed, feats[:, :-1]], dim=-1).flatten(0, 1)  # [B*(T-1), 2H]
    y = feats[:, 1:].flatten(0, 1)  # [B*(T-1), H]
    eye = torch.eye(x.shape[1], dtype=x.dtype, device=x.device)
    weight = torch.linalg.solve(x.T @ x + ridge * eye, x.T @ y).T  # [H, 2H]
    head = init_head(target.model.config, seed=seed)
    head.fc.weight.copy_(weight.to(head.fc.weight.dtype))
    layer = head.layers[0]
    layer.self_attn.o_proj.weight.zero_()  # attention adds nothing to the residual stream
    layer.mlp.down_proj.weight.zero_()  # neither does the MLP: the head's output is fc(...)
    return head.to(device=target.device, dtype=target.dtype).eval().bind(target.embed_tokens, target.lm_head)


@torch.inference_mode()
def greedy_sequences(target, prompts: list[list[int]], new_tokens: int) -> Tensor:
    """[B, P + new_tokens]: each prompt (all of one length P) followed by the target's greedy
    continuation, decoded as one batch by the model's own generate (equal lengths: no padding)."""
    ids = torch.tensor(prompts, dtype=torch.long, device=target.device)  # [B, P]
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    return out.cpu()
