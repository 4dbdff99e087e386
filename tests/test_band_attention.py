"""Band attention for aligned training steps (train/band_attention.py): the same numbers as the
library's attention under the dense `alignment_mask`, for the attention alone and for whole HASS /
EAGLE-3 training steps (outputs and gradients); a wrong band is caught; the head's attention is
restored after the block."""

from __future__ import annotations

import pytest
import torch

from taps.core.target import Target
from taps.core.testing import tiny_model
from taps.drafter.checkpoint import init_head
from taps.train import band_attention as band
from taps.train.band_attention import band_attention, band_attention_in
from taps.train.losses import aligned_outputs, alignment_mask, head_pairs, pad_batch


def dense_reference(query, keys, values, scaling):
    """Eager attention over every step's rows under alignment_mask: [B, T, H, D]."""
    b, heads, t, _ = query.shape
    step, groups = len(keys), heads // keys[0].shape[1]
    k = torch.cat(keys, dim=2).repeat_interleave(groups, dim=1)  # [B, H, j*T, D]
    v = torch.cat(values, dim=2).repeat_interleave(groups, dim=1)
    scores = query @ k.transpose(-1, -2) * scaling + alignment_mask(step, t, query.dtype, query.device)
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (4, 4)])
def test_band_equals_dense_mask(heads, kv_heads):
    g = torch.Generator().manual_seed(0)
    b, t, d = 2, 9, 5
    keys = [torch.randn(b, kv_heads, t, d, generator=g, dtype=torch.float64) for _ in range(7)]
    values = [torch.randn(b, kv_heads, t, 3, generator=g, dtype=torch.float64) for _ in range(7)]
    for step in range(1, 8):
        query = torch.randn(b, heads, t, d, generator=g, dtype=torch.float64)
        got = band_attention(query, keys[:step], values[:step], 0.4)
        want = dense_reference(query, keys[:step], values[:step], 0.4)
        assert got.shape == (b, t, heads, 3)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.fixture(scope="module")
def target():
    model = tiny_model("llama", seed=0, layers=8)
    model.requires_grad_(False)
    return Target(model)


def batch_of(target):
    def sample(length, seed):
        ids = torch.randint(0, target.vocab_size, (length,), generator=torch.Generator().manual_seed(seed))
        target.reset()
        feats = target.prefill(ids, all_logits=True).features.clone()  # [T, F]
        return ids, feats, (torch.arange(length) >= 2).long()
    return pad_batch([sample(13, 1), sample(8, 2)])


def head_and_inputs(target, backbone):
    if backbone == "eagle3":
        head = init_head(target.model.config, seed=3, backbone="eagle3").attach(target)
    else:
        head = init_head(target.model.config, seed=3).bind(target.embed_tokens, target.lm_head)
    pairs = head_pairs(batch_of(target))  # tokens, positions; the features are random, of the head's width
    width = 3 * target.hidden_size if backbone == "eagle3" else target.hidden_size
    return head, pairs, torch.randn(*pairs.tokens.shape, width, generator=torch.Generator().manual_seed(4))


def run_steps(head, pairs, features, steps, dense, detach):
    head.zero_grad()
    inputs = head.fuse(features) if features.shape[-1] != head.config.hidden_size else features
    outs = aligned_outputs(head, pairs.tokens, inputs, pairs.positions, steps, detach=detach, dense=dense)
    loss = sum((out * (j + 1)).square().mean() for j, out in enumerate(outs))
    loss.backward()
    return outs, {name: p.grad.clone() for name, p in head.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("backbone, detach", [("eagle2", True), ("eagle3", False)])
def test_aligned_steps_band_equals_dense(target, backbone, detach):
    head, pairs, features = head_and_inputs(target, backbone)
    band_outs, band_grads = run_steps(head, pairs, features, 7, dense=False, detach=detach)
    dense_outs, dense_grads = run_steps(head, pairs, features, 7, dense=True, detach=detach)
    for got, want in zip(band_outs, dense_outs):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert band_grads.keys() == dense_grads.keys() and len(band_grads) > 3
    for name, want in dense_grads.items():
        torch.testing.assert_close(band_grads[name], want, rtol=1e-4, atol=1e-6, msg=name)


def test_a_wrong_band_is_caught(target, monkeypatch):
    """Diagonal rows read one position stale: step 1 (no diagonals) still agrees, no later step does."""
    head, pairs, features = head_and_inputs(target, "eagle2")
    with torch.no_grad():
        dense = aligned_outputs(head, pairs.tokens, features, pairs.positions, 4, dense=True)
        right = band._shifted
        monkeypatch.setattr(band, "_shifted", lambda rows, lag: right(rows, lag + 1))
        wrong = aligned_outputs(head, pairs.tokens, features, pairs.positions, 4)
    assert float((wrong[0] - dense[0]).abs().max()) < 1e-5
    assert all(float((w - d).abs().max()) > 1e-3 for w, d in zip(wrong[1:], dense[1:]))


def test_attention_is_restored_and_needs_the_rows(target):
    head, pairs, features = head_and_inputs(target, "eagle2")
    before = head.config._attn_implementation
    with pytest.raises(RuntimeError, match="only inside aligned training steps"):
        with band_attention_in(head):
            assert head.config._attn_implementation == band.NAME
            head(pairs.tokens, features, pairs.positions, None)
    assert head.config._attn_implementation == before
