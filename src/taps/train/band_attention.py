"""Band attention for the aligned steps of HASS and EAGLE-3's training-time test: the attention
`alignment_mask` (train/losses.py) defines, without scoring the rows it masks.

Why: at aligned step j a query at position t sees exactly t + 1 key rows: step 1's rows at
p <= t - (j - 1) (a causal block shifted by j - 1), and one row of each later step s = 2..j, at
position t - (j - s) (j - 1 diagonals). Scoring every query against all j * T rows of the steps so
far under a dense additive mask, as the library's attention with `alignment_mask` does, costs
j * T scores per query where t + 1 count: 28 T^2 scores for 3.5 T^2 useful over EAGLE-3's seven
steps, and about 30% of an EAGLE-3 training step on a CPU (docs/eagle3.md). Here each step costs
what step 1 costs: one T x T block against step 1's rows, plus j - 1 dot products per query
against the diagonals, merged in one softmax (float32, as the library's eager attention).

It plugs in through transformers' `AttentionInterface`: `band_attention_in(head)` points the head's
attention at `NAME` for the duration, and each head call passes the steps' rows under the keyword
`BAND_KWARG` (an `AlignedRows`), which the library hands to the attention function untouched. The
head's own cache is not used: the rows are kept per step, never concatenated.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import AttentionInterface

BAND_KWARG = "taps_band"
NAME = "taps_aligned_band"


@dataclass
class AlignedRows:
    """The key and value rows (rope applied) of every aligned step so far, per attention module,
    and the step now running (1-based; the caller advances it before each head call)."""

    step: int = 0
    keys: dict[int, list[Tensor]] = field(default_factory=dict)  # id(module) -> [B, Hkv, T, D] per step
    values: dict[int, list[Tensor]] = field(default_factory=dict)  # id(module) -> [B, Hkv, T, Dv] per step


def _shifted(rows: Tensor, lag: int) -> Tensor:  # [B, Hkv, T, D] -> [B, Hkv, T, D], row t = rows[t - lag]
    """Rows moved `lag` positions later; the first `lag` are zeros (masked by the caller)."""
    if lag == 0:
        return rows
    if lag >= rows.shape[2]:
        return torch.zeros_like(rows)
    return torch.cat([rows.new_zeros(*rows.shape[:2], lag, rows.shape[3]), rows[:, :, :-lag]], dim=2)


def _softmax_dtype(query: Tensor) -> torch.dtype:  # float32 at least, as the library's eager attention
    return torch.promote_types(query.dtype, torch.float32)


def band_attention(query: Tensor, keys: list[Tensor], values: list[Tensor], scaling: float) -> Tensor:
    """Step j = len(keys)'s attention: query [B, H, T, D]; keys[s - 1] / values[s - 1] [B, Hkv, T, D]
    the rows of step s. Returns [B, T, H, Dv], as the library's attention functions do."""
    b, heads, t, dim = query.shape
    kv_heads, step = keys[0].shape[1], len(keys)
    groups = heads // kv_heads
    q = query.view(b, kv_heads, groups, t, dim)  # query head h reads key head h // groups (repeat_kv's order)
    pos = torch.arange(t, device=query.device)  # [T]
    first = torch.matmul(q, keys[0][:, :, None].transpose(-1, -2)) * scaling  # [B, Hkv, G, T, T]
    fill = torch.finfo(first.dtype).min
    first = first.masked_fill(pos[None, :] > pos[:, None] - (step - 1), fill)  # key p <= t - (j - 1)
    if step == 1:
        weights = torch.softmax(first, dim=-1, dtype=_softmax_dtype(query)).to(query.dtype)
        out = torch.matmul(weights, values[0][:, :, None])  # [B, Hkv, G, T, Dv]
        return out.reshape(b, heads, t, -1).transpose(1, 2).contiguous()
    lags = range(step - 2, -1, -1)  # step s = 2..j reads its row at t - (j - s)
    diag_k = torch.stack([_shifted(keys[s], lag) for s, lag in zip(range(1, step), lags)], dim=3)  # [B, Hkv, T, j-1, D]
    diag = torch.einsum("bkgtd,bktsd->bkgts", q, diag_k) * scaling  # [B, Hkv, G, T, j-1]
    lag = torch.arange(step - 2, -1, -1, device=query.device)  # [j-1]
    diag = diag.masked_fill(pos[:, None] < lag[None, :], fill)  # position t - lag < 0: no such row
    weights = torch.softmax(torch.cat([first, diag], dim=-1), dim=-1, dtype=_softmax_dtype(query)).to(query.dtype)
    diag_v = torch.stack([_shifted(values[s], lag) for s, lag in zip(range(1, step), lags)], dim=3)  # [B, Hkv, T, j-1, Dv]
    out = torch.matmul(weights[..., :t], values[0][:, :, None])  # [B, Hkv, G, T, Dv]
    out = out + torch.einsum("bkgts,bktsd->bkgtd", weights[..., t:], diag_v)
    return out.reshape(b, heads, t, -1).transpose(1, 2).contiguous()  # [B, T, H, Dv]


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
               **kwargs):
    rows: AlignedRows | None = kwargs.get(BAND_KWARG)
    if rows is None:
        raise RuntimeError(f"{NAME} attention runs only inside aligned training steps (pass {BAND_KWARG}=AlignedRows)")
    if dropout:
        raise ValueError(f"{NAME} attention has no dropout (got {dropout})")
    keys = rows.keys.setdefault(id(module), [])
    values = rows.values.setdefault(id(module), [])
    keys.append(key)
    values.append(value)
    if len(keys) != rows.step:
        raise RuntimeError(f"aligned step {rows.step}, but {len(keys)} steps of key rows")
    return band_attention(query, keys, values, scaling if scaling is not None else query.shape[-1] ** -0.5), None


AttentionInterface.register(NAME, _attention)


@contextmanager
def band_attention_in(head) -> Iterator[None]:
    """The head's attention layers run `NAME` inside the block (they share `head.config`)."""
    config = head.config
    before = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before
