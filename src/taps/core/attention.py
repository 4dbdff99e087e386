"""Tree attention for the verifier's forwards, plugged in through transformers' own extension
point (`AttentionInterface`), so the model's modules and weights stay the library's.

Why: handing the library a dense additive mask [1, 1, N, prefix + N] made every layer's SDPA
take its masked path, which on a CPU copies the grouped keys and values out to every query head
(`repeat_kv`, O(context) per layer per step) and runs the flash kernel with a mask; at 1,500
tokens of context a 16-node tree forward cost twice a one-token forward (the split is printed by
`taps profile`; docs/long-context.md has what was measured). Here the
committed prefix needs no mask at all (every tree node sees all of it), only the N x N tree block
does, so a tree forward is two small matmuls per layer over the keys as the cache holds them:

  scores  = q [kv_heads, groups * N, D] @ k^T [kv_heads, D, prefix + N]   (no key copy: the
            query heads of one key head are stacked, which is what grouped-query attention means)
  scores[..., prefix:] masked by the ancestor matrix [N, N]   (the only mask, N x N)
  out     = softmax(scores, float32) @ v

with the numerics of the library's eager attention (matmuls in the model's dtype, softmax in
float32). A sliding window masks only the band of the last `window` prefix keys it cuts, and
the keys before it are not read. Anything this path does not model (attention sinks, logit
soft-capping, a model without grouped heads in the usual layout) falls back, with one log line,
to the library's own attention with the dense mask, so every architecture stays exact.

A one-node forward (plain decoding's step: one query that sees every key) has nothing to mask, and
there the matmul path's dozen small operations per layer cost more than attention itself on short
contexts: it runs SDPA's fused kernel instead, with the query heads of each key head stacked as
above (no key copy, no mask), below `ONE_NODE_FUSED_BELOW` committed tokens. Measured on a 2-core
AMD EPYC (both ways, one process, alternating; docs/long-context.md, session 24): 30 layers' attention after 128
tokens 0.57 ms fused against 1.50 ms, the two equal near 640 tokens at one thread and near 1,024
at two, the matmul path ahead beyond (4.7 against 8.1 ms at 2,048). Both are exact in float32 (to
rounding, ~3e-7); the rule depends only on the context and the thread count, so a run's numerics
do not depend on timing.

A tree of several nodes on a short context goes the other way: below `DENSE_TREE_BELOW` committed
tokens it takes the library's own attention with the dense mask (built once per forward). There the
mask is small and the masked fused kernel is quicker than the matmul path, whose bf16 matmuls on a
CPU build a kernel for every new key count (a decoding step's context is always new). Measured on
MT-Bench (eagle2-mixed-xl, fixed 8-token trees, contexts of about 100 to 300 tokens, one thread,
bf16, each path in its own process, alternated; docs/long-context.md, session 25): 30.7 / 29.9 ms per tree forward
against 31.7 / 30.7 on the matmul path, and 6.2 / 5.8 ms of drafting per step against 7.4 / 6.7;
from about 384 tokens on the matmul path is ahead (a 16-node tree after 384 tokens 40.4 against
45.1 ms, after 1,792 48.1 against 69.0). Both are exact in float32. The rule is SDPA's only: the
library's eager attention with a mask copies the keys to every query head and multiplies as the
matmul path does, and measured slower or level at every size (session 26: 4 / 8 / 16 nodes after
64 to 200 tokens, 30.2 against 26.8 ms at worst), so an eager base keeps the matmul path.

A model opts in with `enable(model)`: its attention implementation becomes `taps_tree_<base>`
(base: sdpa or eager), which does exactly what the base does for every forward that is not a
tree forward (prefill, plain forwards, the library's own generate), so those keep their fast
paths. A tree forward is marked by the keyword argument `TREE_KWARG` (a `TreeBlock`), which the
library passes through to the attention function untouched.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from taps.core.stopwatch import now
from taps.core.tree import additive_mask

log = logging.getLogger(__name__)

TREE_KWARG = "taps_tree"
BASES = ("sdpa", "eager")
PREFIX = "taps_tree_"
# keyword arguments that change attention in ways this path does not model: fall back for them
_UNMODELLED = ("softcap", "s_aux", "sinks", "position_bias")


# one-node forwards after fewer committed tokens than this take SDPA's fused kernel (module docstring):
# the measured crossovers at one thread and at two or more
ONE_NODE_FUSED_BELOW = {1: 640}
ONE_NODE_FUSED_BELOW_MANY_THREADS = 1024


# trees of two or more nodes after fewer committed tokens than this take the library's attention with
# the dense mask (module docstring; a gain in real decoding at one thread and at two)
DENSE_TREE_BELOW = 256


def dense_tree(nodes: int, prefix: int) -> bool:
    """Whether a tree forward of `nodes` nodes after `prefix` committed rows runs the library's
    attention with the dense mask instead of the matmul path, where the base is SDPA (an eager base
    keeps the matmul path: `attend` reads this flag only for SDPA)."""
    return nodes > 1 and prefix < DENSE_TREE_BELOW


def fused_one_node(prefix: int) -> bool:
    """Whether a one-node forward after `prefix` committed rows runs SDPA's fused kernel."""
    return prefix < ONE_NODE_FUSED_BELOW.get(torch.get_num_threads(), ONE_NODE_FUSED_BELOW_MANY_THREADS)


@dataclass(frozen=True)
class TreeBlock:
    """What a tree forward's attention needs beyond q, k, v: the last N key rows are the tree.
    Its tensors are on the model's device (every layer reads them: no per-layer copies)."""

    ancestors: Tensor  # [N, N] bool: node i sees node j (its ancestors and itself)
    depth: Tensor  # [N] long, node depth below the root (the root is at position `prefix`)
    prefix: int  # committed rows before the tree block
    hidden: Tensor = field(init=False, repr=False, compare=False)  # [N, N] bool: ~ancestors
    fused: bool = field(init=False, repr=False, compare=False)  # one node on a short context (`fused_one_node`)
    dense: bool = field(init=False, repr=False, compare=False)  # a tree on a short context (`dense_tree`; SDPA)
    _masks: dict = field(init=False, repr=False, compare=False)  # (window, dtype) -> dense mask, once per forward

    def __post_init__(self) -> None:  # once per forward, not once per layer
        nodes = self.ancestors.shape[0]
        object.__setattr__(self, "hidden", ~self.ancestors)
        object.__setattr__(self, "fused", nodes == 1 and fused_one_node(self.prefix))
        object.__setattr__(self, "dense", dense_tree(nodes, self.prefix))
        object.__setattr__(self, "_masks", {})

    def dense_mask(self, window: int | None, dtype: torch.dtype) -> Tensor:  # [1, 1, N, prefix + N]
        key = (window, dtype)
        if key not in self._masks:
            self._masks[key] = additive_mask(self.ancestors, self.depth, self.prefix, window, dtype)
        return self._masks[key]


_warned: set[str] = set()


def _note_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


def _base_function(module, base: str):
    """The attention the model would run without us: the library's SDPA, or the model file's own
    eager function (each architecture has its own)."""
    if base == "sdpa":
        return ALL_ATTENTION_FUNCTIONS["sdpa"]
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(f"{type(module).__name__}: its modeling file has no eager_attention_forward")
    return eager


def tree_attention(query: Tensor, key: Tensor, value: Tensor, tree: TreeBlock, scaling: float,
                   window: int | None) -> Tensor:
    """Attention of the N tree queries over the committed prefix (unmasked) and the tree block
    (ancestor mask), eager's numerics; a one-node forward on a short context, SDPA's fused kernel
    (`TreeBlock.fused`). query [1, H, N, D], key / value [1, Hkv, prefix + N, D] (value's D may
    differ); returns [1, N, H, Dv] as the library's attention functions do."""
    _, heads, n, dim = query.shape
    kv_heads, total = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    prefix = total - n
    q = query.reshape(1, kv_heads, groups * n, dim)  # head h = kv head h // groups (copies N rows, not keys)
    start = 0 if window is None else max(0, prefix - window + 1)  # keys before it: outside every window
    if tree.fused and start == 0:  # one query, no key outside a window: nothing masked, the fused kernel
        out = F.scaled_dot_product_attention(q, key, value, scale=scaling)  # [1, Hkv, groups, Dv]
        return out.view(1, heads, 1, -1).transpose(1, 2).contiguous()  # [1, 1, H, Dv]
    hidden = tree.hidden  # [N, N]
    band = None
    if window is not None:
        # query i (position prefix + d_i) sees key position k iff prefix + d_i - k < window
        depth = tree.depth
        q_pos = prefix + depth  # [N]
        k_pos = torch.arange(start, prefix, device=query.device)  # [prefix - start]
        band = (q_pos[:, None] - k_pos[None, :]) < window  # [N, prefix - start]
        hidden = hidden | ((depth[:, None] - depth[None, :]) >= window)
    k = key[:, :, start:]  # [1, Hkv, K, D], K = prefix - start + N
    if math.frexp(scaling)[0] == 0.5:  # a power of two (1 / sqrt(64)): scaling the N query rows instead of
        scores = torch.matmul(q * scaling, k.transpose(2, 3))  # the N x K scores rounds the same, ~10 % faster
    else:
        scores = torch.matmul(q, k.transpose(2, 3)) * scaling  # [1, Hkv, groups * N, K]
    scores = scores.view(1, kv_heads, groups, n, k.shape[2])
    fill = torch.finfo(scores.dtype).min
    scores[..., prefix - start:].masked_fill_(hidden, fill)
    if band is not None and not bool(band.all()):
        scores[..., : prefix - start].masked_fill_(~band, fill)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(weights.view(1, kv_heads, groups * n, k.shape[2]), value[:, :, start:])  # [1, Hkv, groups * N, Dv]
    return out.view(1, heads, n, -1).transpose(1, 2).contiguous()  # [1, N, H, Dv]


def _unsupported(module, query: Tensor, key: Tensor, kwargs: dict) -> str | None:
    """Why this call cannot take the tree path (None: it can)."""
    if query.shape[0] != 1:
        return "batch size above 1"
    if query.shape[1] % key.shape[1]:
        return f"{query.shape[1]} query heads over {key.shape[1]} key heads"
    found = [name for name in _UNMODELLED if kwargs.get(name) is not None]
    if found:
        return f"{type(module).__name__} passes {', '.join(found)}"
    return None


_clock: list[float] | None = None  # set by timed(): seconds of each attention call


@contextmanager
def timed() -> Iterator[list[float]]:
    """Profiling only (`taps profile`'s split of a verify step): collects the seconds of every
    attention call made inside the block, tree path or base, each read on the device's clock."""
    global _clock
    outer, _clock = _clock, []
    try:
        yield _clock
    finally:
        _clock = outer


def _make(base: str):
    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs):
        if _clock is None:
            return attend(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
        start = now(query.device)
        out = attend(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
        _clock.append(now(query.device) - start)
        return out

    def attend(module, query, key, value, attention_mask, dropout, scaling, **kwargs):
        tree = kwargs.pop(TREE_KWARG, None)
        if tree is None:  # not a tree forward: exactly the base implementation
            return _base_function(module, base)(module, query, key, value, attention_mask, dropout=dropout,
                                                scaling=scaling, **kwargs)
        window = kwargs.get("sliding_window")
        window = int(window) if window else None
        why = _unsupported(module, query, key, kwargs)
        if why is None and not (tree.dense and base == "sdpa"):  # the dense rule is SDPA's fused kernel's
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            return tree_attention(query, key, value, tree, scale, window), None
        if why is not None:
            _note_once(f"tree attention: {why}; verifying with the library's {base} attention and a dense "
                       f"[N, prefix + N] mask instead (exact, slower on long contexts)")
        mask = tree.dense_mask(window, query.dtype)  # on the model's device, as the tree block is
        return _base_function(module, base)(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                                            **kwargs)

    attention.__name__ = f"{PREFIX}{base}"
    return attention


for _base in BASES:
    AttentionInterface.register(f"{PREFIX}{_base}", _make(_base))
    AttentionMaskInterface.register(f"{PREFIX}{_base}", ALL_MASK_ATTENTION_FUNCTIONS[_base])


def enable(model) -> bool:
    """Route this model's attention through the tree path (its own base for everything else).
    False, with one log line, where the model's attention is not one we wrap (flash, flex, a
    custom kernel): the Target then verifies with the dense mask, as before."""
    current = model.config._attn_implementation
    if current.startswith(PREFIX):
        return True
    if current not in BASES:
        _note_once(f"tree attention: {type(model).__name__} runs {current!r} attention, which TAPS does not wrap; "
                   "verifying trees with a dense [N, prefix + N] mask")
        return False
    model.set_attn_implementation(f"{PREFIX}{current}")
    if model.config._attn_implementation != f"{PREFIX}{current}":
        _note_once(f"tree attention: {type(model).__name__} does not take an AttentionInterface function; "
                   "verifying trees with a dense [N, prefix + N] mask")
        return False
    return True


def base_implementation(model) -> str:
    """The model's attention as loaded (sdpa, eager, ...), whether or not the tree path is on."""
    return str(model.config._attn_implementation).removeprefix(PREFIX)
