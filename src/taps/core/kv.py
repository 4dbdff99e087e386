"""Cache surgery on the library's own `DynamicCache`: keep the accepted rows, drop the rest.

All knowledge of the cache's internals (layers with `.keys` / `.values` of shape
[batch, kv_heads, seq, head_dim]) lives here and in target.py, so a change of the
transformers cache API touches these two files only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor
from transformers import DynamicCache

from taps.core.stopwatch import now


def new_cache() -> DynamicCache:
    """A cache of plain (non-sliding) dynamic layers: sliding windows are enforced by our masks,
    so no layer ever drops a row we might still need."""
    return DynamicCache()


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def truncate(cache: DynamicCache, length: int) -> None:
    """Drop every row at or after `length`."""
    current = cache_length(cache)
    if length > current:
        raise ValueError(f"cannot truncate a cache of {current} rows to {length}")
    if length < current:
        cache.crop(length - current)


@torch.inference_mode()
def keep_rows(cache: DynamicCache, start: int, rows: Tensor) -> None:
    """Keep rows [0, start) and then rows start + rows[i], in that order; drop everything else.

    rows: [M] long, offsets into the block appended after `start` (e.g. accepted tree nodes).
    Only the tail is rewritten, so the cost is O(M) per layer, not O(sequence).
    """
    rows = rows.to(torch.long)
    m = int(rows.shape[0])
    contiguous = bool(torch.equal(rows.cpu(), torch.arange(m)))
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        if not contiguous:
            index = (rows + start).to(layer.keys.device)
            layer.keys[:, :, start : start + m] = layer.keys.index_select(2, index)
            layer.values[:, :, start : start + m] = layer.values.index_select(2, index)
    truncate(cache, start + m)


@contextmanager
def timed_updates(cache: DynamicCache, device: torch.device) -> Iterator[list[float]]:
    """Profiling only (`taps profile`'s split of a verify step): collects the seconds of every
    row append (the cache's `update`, one per layer per forward) made inside the block."""
    spent: list[float] = []
    update = cache.update

    def timed(*args, **kwargs):
        start = now(device)
        out = update(*args, **kwargs)
        spent.append(now(device) - start)
        return out

    cache.update = timed  # an instance attribute, shadowing the method until the block ends
    try:
        yield spent
    finally:
        del cache.update
