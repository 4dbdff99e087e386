"""Training losses: the HASS training-time attention equals the decoder's inference attention (and
a mutated mask breaks that), known values by hand, masking/padding, gradients, determinism."""

import math
from dataclasses import replace

import pytest
import torch

from taps.core.config import TreeConfig
from taps.drafter.checkpoint import init_head
from taps.drafter.context import causal_block_mask, consume
from taps.drafter.expand import expand_tree
from taps.core.target import Target
from taps.core.testing import tiny_model
from taps.train import losses
from taps.train.losses import (
    Eagle2Config, HassConfig, Teacher, TrainBatch, aligned_outputs, alignment_mask, eagle2_loss, hass_loss,
    head_pairs, pad_batch, step_terms,
)
from taps.train.trainer import has_compiler
from taps.core.tree import additive_mask

NO_NOISE = dict(noise_width=0.0)


@pytest.fixture(scope="module")
def target():
    model = tiny_model("llama", seed=0)
    model.requires_grad_(False)  # the target is shared and frozen
    return Target(model)


def make_head(target, seed=0):
    return init_head(target.model.config, seed=seed).bind(target.embed_tokens, target.lm_head)


def features_of(target, ids):  # [T] -> [T, H] true target features
    target.reset()
    return target.prefill(ids, all_logits=True).features.clone()  # clone: a normal (not inference) tensor


def sample(target, length, seed, prompt=3):
    """(input_ids [T], hidden [T, H], loss_mask [T]): `prompt` user tokens, then assistant tokens."""
    ids = torch.randint(0, target.vocab_size, (length,), generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(length) >= prompt).long()
    return ids, features_of(target, ids), mask


@pytest.fixture(scope="module")
def batch(target):
    return pad_batch([sample(target, 14, seed=1), sample(target, 10, seed=2)])


# ---- the decisive test: training-time attention == inference-time attention -------------------
def inference_chain(head, ids, feats, c, depth):
    """Head outputs at depths 1..depth of a chain after c committed pairs, run as the decoder runs:
    consume() over the true context, then expand.py's chain step (top_k = 1: each step attends to
    the context and its own ancestors, position = context + level - 2), fed the previous output as
    the feature and the ground-truth next token."""
    with torch.inference_mode():
        ctx = consume(head, None, ids[1 : c + 1], feats[:c])
        outs, feat = [ctx.root_hidden.clone()], ctx.root_hidden  # depth 1 reads the root's output
        anc = torch.zeros(1, 0, dtype=torch.bool)
        for level in range(2, depth + 1):
            anc = torch.cat([anc, torch.ones(1, 1, dtype=torch.bool)], dim=1)  # [1, level-1] chain ancestors
            mask = additive_mask(anc, None, ctx.length, None, feat.dtype)
            positions = torch.full((1, 1), ctx.length + level - 2)
            feat = head(ids[c + level - 1].view(1, 1), feat.view(1, 1, -1), positions, mask, ctx.cache)[0, 0]
            outs.append(feat.clone())
    return outs


def deviation_by_depth(head, batch, steps, dense=False):
    """max |training step d output at t = c + d - 2 - inference depth-d output| over every row,
    context length c and depth d; one value per depth (band attention, or the dense mask)."""
    pairs = head_pairs(batch)
    with torch.no_grad():
        train = aligned_outputs(head, pairs.tokens, pairs.features, pairs.positions, steps, dense=dense)
    worst = [0.0] * steps
    for b, length in enumerate(batch.lengths.tolist()):
        ids, feats = batch.input_ids[b, :length], batch.hidden[b, :length]
        for c in range(1, length - 1):
            depth = min(steps, length - c)  # pair t = c + d - 2 must exist: t <= length - 2
            for d, inf in enumerate(inference_chain(head, ids, feats, c, depth), start=1):
                err = float((train[d - 1][b, c + d - 2] - inf).abs().max())
                worst[d - 1] = max(worst[d - 1], err)
    return worst


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("steps", [3, 4])
def test_training_attention_equals_inference(target, batch, steps, dense):
    worst = deviation_by_depth(make_head(target, seed=1), batch, steps, dense)
    assert max(worst) < 1e-5, worst


def authors_bug(step, length, dtype, device):
    """The reference HASS code: masked logits set to 0, i.e. no causal mask in alignment steps."""
    if step == 1:
        return causal_block_mask(length, 0, dtype, device)
    return torch.zeros(1, 1, length, step * length, dtype=dtype, device=device)


def stale_rows(step, length, dtype, device):
    """Off by one step: at depth >= 3 the recent keys read the true-feature rows; only the
    diagonal reads step j (right for step 2, wrong from step 3 on)."""
    if step == 1:
        return alignment_mask(1, length, dtype, device)
    two = alignment_mask(2, length, dtype, device)  # [1, 1, T, 2T]
    unseen = torch.full_like(two[..., :length], torch.finfo(dtype).min)  # [1, 1, T, T]
    return torch.cat([two[..., :length]] + [unseen] * (step - 2) + [two[..., length:]], dim=-1)


@pytest.mark.parametrize("mutant, broken_from", [(authors_bug, 2), (stale_rows, 3)])
def test_mutated_mask_breaks_equality(target, batch, monkeypatch, mutant, broken_from):
    """The mask is what the equality test checks: on the dense path, a wrong one breaks it."""
    monkeypatch.setattr(losses, "alignment_mask", mutant)
    worst = deviation_by_depth(make_head(target, seed=1), batch, 3, dense=True)
    assert max(worst[: broken_from - 1]) < 1e-5, worst  # depths the mutant still gets right
    assert min(worst[broken_from - 1 :]) > 1e-3, worst


def test_training_logprobs_equal_expand_tree_chain(target):
    """Against expand_tree itself: the head's greedy chain after a context, teacher-forced into a
    training sequence, gets the same cumulative log-probs from the alignment steps."""
    head, depth, c = make_head(target, seed=2), 4, 7
    ids, feats, _ = sample(target, c + 1, seed=3)  # context pairs 0..c-1, root token at position c
    ctx = consume(head, None, ids[1:], feats[:c])
    tree = expand_tree(head, ctx, TreeConfig(depth + 1, depth, 1))
    seq = torch.cat([ids, tree.tokens[1:]])  # [c + 1 + depth]
    hidden = torch.cat([feats, torch.zeros(depth, feats.shape[1])])  # drafted positions: never read as true
    pairs = head_pairs(pad_batch([(seq, hidden, torch.ones_like(seq))]))
    with torch.no_grad():
        outs = aligned_outputs(head, pairs.tokens, pairs.features, pairs.positions, depth)
        cum = 0.0
        for d in range(1, depth + 1):
            logp = torch.log_softmax(head.logits(outs[d - 1][0, c + d - 2]), dim=-1)  # [V]
            cum += float(logp[tree.tokens[d]])
            assert abs(cum - float(tree.logp[d])) < 1e-4, d


def test_alignment_mask_pattern():
    keep = lambda m: (m[0, 0] == 0).int().tolist()  # noqa: E731
    assert torch.equal(alignment_mask(1, 4, torch.float32, "cpu"), causal_block_mask(4, 0, torch.float32, "cpu"))
    # keys: step-1 rows p0 p1 p2, then step-2 rows p0 p1 p2
    assert keep(alignment_mask(2, 3, torch.float32, "cpu")) == [
        [0, 0, 0, 1, 0, 0],
        [1, 0, 0, 0, 1, 0],
        [1, 1, 0, 0, 0, 1],
    ]
    # step 3, query 3: p0 p1 from step 1, p2 from step 2, p3 from step 3
    row = keep(alignment_mask(3, 4, torch.float32, "cpu"))[3]
    assert row == [1, 1, 0, 0] + [0, 0, 1, 0] + [0, 0, 0, 1]


# ---- known values ----------------------------------------------------------------------------
def test_eagle2_loss_known_value(target):
    """A head with every weight 0 outputs 0 and uniform logits, so the loss is SmoothL1(0, next
    feature) + 0.1 * log V, whatever the input (noise included: the targets are never noised)."""
    head = make_head(target)
    for p in head.parameters():
        p.data.zero_()
    h, v = target.hidden_size, target.vocab_size
    levels = torch.tensor([0.5, -2.0, 0.25, 3.0, 1.0, -0.5])  # feature value of each position
    ids = torch.arange(6)
    mask = torch.tensor([0, 0, 1, 1, 0, 1])  # counts pairs t = 1, 2, 4 (targets 0.25, 3.0, -0.5)
    short = (ids[:2], torch.full((2, h), 9.0), torch.ones(2))  # counts pair 0 (target 9.0); then padding
    batch = pad_batch([(ids, levels[:, None].expand(6, h), mask), short])
    smooth = lambda x: 0.5 * x * x if abs(x) < 1 else abs(x) - 0.5  # noqa: E731  SmoothL1, beta 1
    expected_feature = (smooth(0.25) + smooth(3.0) + smooth(-0.5) + smooth(9.0)) / 4
    noisy = (Eagle2Config(noise_width=0.5), torch.Generator().manual_seed(0))
    for cfg, gen in [(Eagle2Config(**NO_NOISE), None), noisy]:
        out = eagle2_loss(head, batch, cfg, gen)
        assert float(out.steps[0].count) == 4
        assert out.steps[0].feature.item() == pytest.approx(expected_feature, rel=1e-6)
        assert out.steps[0].token.item() == pytest.approx(math.log(v), rel=1e-6)
        assert out.loss.item() == pytest.approx(expected_feature + 0.1 * math.log(v), rel=1e-6)


def test_step_terms_hand_made():
    q = torch.tensor([[[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]]])  # [1, 2, 4] target distribution
    logits = torch.log(torch.tensor([[[0.25] * 4, [0.1, 0.6, 0.2, 0.1]]]))  # [1, 2, 4] head
    predicted = torch.tensor([[[0.0, 0.0], [1.0, 1.0]]])  # [1, 2, 2]
    targets = torch.tensor([[[0.5, -3.0], [1.0, 1.0]]])  # [1, 2, 2]
    only_first = torch.tensor([[True, False]])
    s = step_terms(predicted, logits, Teacher(targets, q, topk=2), only_first)
    assert s.feature.item() == pytest.approx((0.125 + 2.5) / 2)
    assert s.token.item() == pytest.approx(math.log(4))  # -sum q log(1/4)
    assert s.distill.item() == pytest.approx((0.5 + 0.3) * math.log(4))  # top-2 of q: 0.5 and 0.3, not renormalised
    both = step_terms(predicted, logits, Teacher(targets, q, topk=2), torch.tensor([[True, True]]))
    second = -(0.4 * math.log(0.1) + 0.3 * math.log(0.2))
    assert both.distill.item() == pytest.approx(((0.5 + 0.3) * math.log(4) + second) / 2)
    # argmax: head picks 0 (tie, first) vs target 0; head 1 vs target 3
    assert both.top1.item() == pytest.approx(0.5) and s.top1.item() == pytest.approx(1.0)
    assert step_terms(predicted, logits, Teacher(targets, q, topk=None), only_first).distill.item() == 0.0


# ---- a draft vocabulary (EAGLE-3): every vocabulary-sized term over N tokens ------------------------
def two_dim_head(draft_ids, scale=2.0):
    """A head on a hand-made 'target' of hidden size 2 and vocabulary 4: lm_head(f) = log [1, 2, 3, 4]
    for f = [1, 0]; the head's attention and MLP add nothing and fc maps (embed, f) to scale * f."""
    from torch import nn
    from transformers import LlamaConfig

    from taps.drafter.head import EagleHead

    config = LlamaConfig(vocab_size=4, hidden_size=2, intermediate_size=2, num_attention_heads=1,
                         num_key_value_heads=1, head_dim=2, num_hidden_layers=1)
    head = EagleHead(config)
    lm_head, embed = nn.Linear(2, 4, bias=False), nn.Embedding(4, 2)
    with torch.no_grad():
        lm_head.weight.copy_(torch.tensor([[math.log(x), 0.0] for x in (1.0, 2.0, 3.0, 4.0)]))
        head.fc.weight.copy_(torch.tensor([[0.0, 0.0, scale, 0.0], [0.0, 0.0, 0.0, scale]]))
        head.layers[0].self_attn.o_proj.weight.zero_()
        head.layers[0].mlp.down_proj.weight.zero_()
    lm_head.requires_grad_(False)
    embed.requires_grad_(False)
    return head.bind(embed, lm_head).set_draft_vocab(torch.tensor(draft_ids))


def test_draft_vocab_loss_hand_computed():
    """Draft tokens {1, 3} of 4. The target's distribution at f is [.1, .2, .3, .4]; restricted and
    renormalised q = [1/3, 2/3]; the head outputs 2f, so p = softmax(2 log [2, 4]) = [.2, .8].
    Soft cross-entropy -(1/3 log .2 + 2/3 log .8), top-1 distillation -(2/3) log .8, feature
    SmoothL1(2f, f) = 0.25; the target's argmax 3 is the head's (draft index 1): top-1 = 1. Over
    draft tokens {1, 2} the target's argmax is outside the vocabulary: a miss."""
    f = torch.tensor([1.0, 0.0])
    batch = pad_batch([(torch.tensor([0, 1, 2, 3]), f.expand(4, 2).clone(), torch.ones(4))])  # 3 counted pairs
    token = -(1 / 3 * math.log(0.2) + 2 / 3 * math.log(0.8))
    for loss_fn, cfg in [(eagle2_loss, Eagle2Config(**NO_NOISE)), (hass_loss, HassConfig(**NO_NOISE, topk=1, steps=1))]:
        out = loss_fn(two_dim_head([1, 3]), batch, cfg)
        step = out.steps[0]
        assert float(step.count) == 3
        assert step.feature.item() == pytest.approx(0.25, rel=1e-6)
        assert step.token.item() == pytest.approx(token, rel=1e-6)
        distill = -(2 / 3) * math.log(0.8) if loss_fn is hass_loss else 0.0
        assert step.distill.item() == pytest.approx(distill, rel=1e-6, abs=1e-9)
        assert out.loss.item() == pytest.approx(0.25 + 0.1 * token + distill, rel=1e-6)
        assert step.top1.item() == 1.0
    # draft tokens {1, 2}: q = [.4, .6], p = softmax(2 log [2, 3]) = [4/13, 9/13]; argmax 3 is outside
    out = eagle2_loss(two_dim_head([1, 2]), batch, Eagle2Config(**NO_NOISE))
    assert out.steps[0].token.item() == pytest.approx(-(0.4 * math.log(4 / 13) + 0.6 * math.log(9 / 13)), rel=1e-6)
    assert out.steps[0].top1.item() == 0.0


@pytest.mark.parametrize("loss_fn, cfg", [(eagle2_loss, Eagle2Config(**NO_NOISE)),
                                          (hass_loss, HassConfig(**NO_NOISE, topk=3))])
def test_draft_vocab_loss_is_the_restricted_soft_cross_entropy(target, batch, loss_fn, cfg):
    """On the tiny target, by hand from the head's outputs: q = softmax over the draft rows of the
    target's logits, log p = log-softmax over the same rows, top-K in draft index space."""
    ids = torch.tensor([1, 5, 9, 40, 77, 200, 301, 383])
    head = make_head(target, seed=2).set_draft_vocab(ids)
    out = loss_fn(head, batch, cfg)
    pairs = head_pairs(batch)
    w = pairs.weight  # [B, T-1]
    steps = len(out.steps)
    with torch.no_grad():
        outs = aligned_outputs(head, pairs.tokens, pairs.features, pairs.positions, steps)
        full_q = target.lm_head(pairs.targets[w])  # [P, V]
        q = torch.softmax(full_q[:, ids], dim=-1)  # [P, N]
    t = torch.arange(w.shape[1]).expand_as(w)[w]  # [P]
    for j, o in enumerate(outs, start=1):
        logp = torch.log_softmax(target.lm_head(o[w])[:, ids], dim=-1)  # [P, N]
        keep = t >= j - 1
        assert torch.allclose(out.steps[j - 1].token, (-(q * logp).sum(-1))[keep].mean(), atol=1e-5)
        if loss_fn is hass_loss:
            top_q, top_x = q.topk(3, dim=-1)
            assert torch.allclose(out.steps[j - 1].distill, (-(top_q * logp.gather(-1, top_x)).sum(-1))[keep].mean(),
                                  atol=1e-5)
        guess = ids[logp.argmax(-1)]
        agree = (guess == full_q.argmax(-1)).float()[keep].mean()  # the target's FULL argmax
        assert torch.allclose(out.steps[j - 1].top1, agree)


@pytest.mark.parametrize("loss_fn, cfg", [(eagle2_loss, Eagle2Config()), (hass_loss, HassConfig())])
def test_draft_vocab_training_never_runs_the_full_lm_head(target, batch, loss_fn, cfg):
    """The saving is real: a training step (no top-1 metric) computes [.., N] logits only; the
    evaluation's top-1 metric runs the full LM head once, for the target's argmax."""
    ids = torch.arange(0, 384, 8)  # N = 48
    head = make_head(target).set_draft_vocab(ids)
    widths = []
    hook = target.lm_head.register_forward_hook(lambda m, i, o: widths.append(o.shape[-1]))
    try:
        out = loss_fn(head, batch, replace(cfg, top1=False), torch.Generator().manual_seed(0))
        out.loss.backward()
        assert widths == []
        loss_fn(head, batch, replace(cfg, top1=True), torch.Generator().manual_seed(0))
        assert widths == [384]
    finally:
        hook.remove()
    assert losses.target_distribution(head, batch.hidden[0]).shape == (batch.hidden.shape[1], 48)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters())


def test_step_terms_over_a_draft_vocabulary_map_the_argmax():
    logits = torch.tensor([[[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]]])  # [1, 2, 3] over draft ids [4, 7, 9]
    q = torch.softmax(logits, -1)
    x = torch.zeros(1, 2, 2)
    both = torch.tensor([[True, True]])
    s = step_terms(x, logits, Teacher(x, q, q_argmax=torch.tensor([[7, 5]]), draft_ids=torch.tensor([4, 7, 9])), both)
    assert s.top1.item() == pytest.approx(0.5)  # 7 == 7; 4 != 5 (5 is outside the draft vocabulary)
    with pytest.raises(ValueError, match="q_argmax in target ids"):
        step_terms(x, logits, Teacher(x, q, draft_ids=torch.tensor([4, 7, 9])), both)


# ---- masking and padding ---------------------------------------------------------------------
def scramble_padding(batch, seed):
    g = torch.Generator().manual_seed(seed)
    pad = torch.arange(batch.input_ids.shape[1])[None] >= batch.lengths[:, None]  # [B, T]
    ids = torch.where(pad, torch.randint(0, 384, batch.input_ids.shape, generator=g), batch.input_ids)
    hidden = torch.where(pad[..., None], torch.randn(batch.hidden.shape, generator=g) * 10, batch.hidden)
    mask = torch.where(pad, torch.ones_like(batch.loss_mask), batch.loss_mask)
    return TrainBatch(input_ids=ids, hidden=hidden, loss_mask=mask, lengths=batch.lengths)


@pytest.mark.parametrize("loss_fn, cfg", [(eagle2_loss, Eagle2Config(**NO_NOISE)), (hass_loss, HassConfig(**NO_NOISE))])
def test_padding_and_masked_positions_do_not_count(target, batch, loss_fn, cfg):
    head = make_head(target)
    loss = lambda b: loss_fn(head, b, cfg).loss  # noqa: E731
    assert torch.allclose(loss(batch), loss(scramble_padding(batch, seed=5)), atol=1e-6)
    # the short row alone, unpadded, or padded with garbage: the same loss
    row = TrainBatch(batch.input_ids[1:], batch.hidden[1:], batch.loss_mask[1:], batch.lengths[1:])
    alone = pad_batch([(row.input_ids[0, :10], row.hidden[0, :10], row.loss_mask[0, :10])])
    assert torch.allclose(loss(alone), loss(scramble_padding(row, seed=6)), atol=1e-6)
    # trailing non-assistant tokens (loss_mask 0 from position 11) feed nothing counted: free to change
    tail = replace(batch, loss_mask=batch.loss_mask.clone())
    tail.loss_mask[0, 11:] = 0
    changed = replace(tail, input_ids=tail.input_ids.clone(), hidden=tail.hidden.clone())
    changed.hidden[0, 11:] += 1.0  # hidden[11]: target of pair 10 (uncounted), input of pair 11
    changed.input_ids[0, 11:] = 7  # input_ids[11]: token of pair 10
    assert torch.allclose(loss(tail), loss(changed), atol=1e-6)
    counted = replace(tail, hidden=tail.hidden.clone())
    counted.hidden[0, 10] += 1.0  # the target of pair 9, which is counted: the loss must move
    assert not torch.allclose(loss(tail), loss(counted), atol=1e-4)
    # the first token's loss_mask never counts (pair t is counted by loss_mask[t + 1])
    first = replace(batch, loss_mask=batch.loss_mask.clone())
    first.loss_mask[:, 0] = 1 - first.loss_mask[:, 0]
    assert torch.equal(loss(batch), loss(first))


def test_hass_counts_each_step_on_its_positions(target, batch):
    out = hass_loss(make_head(target), batch, HassConfig(**NO_NOISE))
    weight = head_pairs(batch).weight  # [B, T-1]
    t = torch.arange(weight.shape[1])
    assert [int(s.count) for s in out.steps] == [int((weight & (t >= j - 1)).sum()) for j in (1, 2, 3)]
    expected = sum(s.feature + 0.1 * s.token + 1.0 * s.distill for s in out.steps)
    assert torch.allclose(out.loss, expected)
    names = ("feature", "token", "distill", "top1")
    assert set(out.metrics()) == {"loss"} | {f"{n}/{j}" for n in names for j in (1, 2, 3)}


# ---- gradients -------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_fn, cfg", [(eagle2_loss, Eagle2Config()), (hass_loss, HassConfig())])
def test_gradients_reach_only_head_parameters(target, batch, loss_fn, cfg):
    head = make_head(target)
    shared = {id(p) for p in (*target.embed_tokens.parameters(), *target.lm_head.parameters())}
    assert not shared & {id(p) for p in head.parameters()}
    loss_fn(head, batch, cfg, torch.Generator().manual_seed(0)).loss.backward()
    for name, p in head.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    assert target.embed_tokens.weight.grad is None and target.lm_head.weight.grad is None


def test_unfrozen_target_is_refused():
    model = tiny_model("llama", seed=0)  # parameters require grad
    unfrozen = Target(model)
    head = init_head(model.config).bind(unfrozen.embed_tokens, unfrozen.lm_head)
    ids = torch.arange(5)
    batch = pad_batch([(ids, torch.zeros(5, unfrozen.hidden_size), torch.ones(5))])
    for fn in (eagle2_loss, hass_loss):
        with pytest.raises(ValueError, match="freeze the target"):
            fn(head, batch)


def test_step_inputs_are_detached(target, batch):
    head = make_head(target)
    pairs = head_pairs(batch)
    outs = aligned_outputs(head, pairs.tokens, pairs.features, pairs.positions, 3)
    for j in (1, 2):
        # a later step reads the earlier outputs only as detached inputs: no path back into them
        assert torch.autograd.grad(outs[j].sum(), outs[j - 1], retain_graph=True, allow_unused=True) == (None,)
    # ... while the parameters are reached (through the earlier steps' key/value rows as well)
    grads = torch.autograd.grad(outs[2][:, 3:].sum(), [head.fc.weight, head.layers[0].self_attn.k_proj.weight])
    assert all(g.abs().sum() > 0 for g in grads)


# ---- equivalence and determinism -------------------------------------------------------------
def test_hass_one_step_without_distillation_is_eagle2(target, batch):
    head = make_head(target)
    eagle = eagle2_loss(head, batch, Eagle2Config(noise_width=0.3), torch.Generator().manual_seed(4))
    one_step = HassConfig(noise_width=0.3, steps=1, topk_weight=0.0)
    hass = hass_loss(head, batch, one_step, torch.Generator().manual_seed(4))
    assert torch.allclose(eagle.loss, hass.loss, atol=1e-6)
    for name in ("feature", "token", "top1", "count"):
        assert torch.allclose(getattr(eagle.steps[0], name).float(), getattr(hass.steps[0], name).float(), atol=1e-6)


@pytest.mark.parametrize("loss_fn, cfg", [(eagle2_loss, Eagle2Config()), (hass_loss, HassConfig())])
def test_noise_is_seeded(target, batch, loss_fn, cfg):
    head = make_head(target)
    run = lambda seed: loss_fn(head, batch, cfg, torch.Generator().manual_seed(seed)).loss  # noqa: E731
    assert torch.equal(run(0), run(0))
    assert not torch.equal(run(0), run(1))
    clean = loss_fn(head, batch, type(cfg)(**NO_NOISE))  # no noise, no generator needed
    assert not torch.equal(run(0), clean.loss)
    with pytest.raises(ValueError, match="Generator"):
        loss_fn(head, batch, cfg)


def test_config_validation():
    with pytest.raises(ValueError):
        HassConfig(steps=0)
    with pytest.raises(ValueError):
        Eagle2Config(noise_width=-1.0)
    with pytest.raises(ValueError):
        TrainBatch(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, 4), torch.zeros(1, 3), torch.tensor([4]))


@pytest.mark.parametrize("loss_fn, cfg", [(eagle2_loss, Eagle2Config()), (hass_loss, HassConfig())])
def test_skipping_the_top1_metric_changes_no_loss_or_gradient(target, batch, loss_fn, cfg):
    head = make_head(target)

    def run(top1: bool):
        head.zero_grad(set_to_none=True)
        out = loss_fn(head, batch, replace(cfg, top1=top1), torch.Generator().manual_seed(3))
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in head.named_parameters()}

    (on, grads_on), (off, grads_off) = run(True), run(False)
    assert torch.equal(on.loss, off.loss) and all(torch.equal(grads_on[n], grads_off[n]) for n in grads_on)
    assert all(0.0 <= float(s.top1) <= 1.0 for s in on.steps) and all(torch.isnan(s.top1) for s in off.steps)


@pytest.mark.skipif(not has_compiler(), reason="torch.compile on the CPU needs a C++ compiler")
@pytest.mark.parametrize("loss_fn, cfg", [(eagle2_loss, Eagle2Config()), (hass_loss, HassConfig())])
def test_compiled_loss_equals_eager(target, batch, loss_fn, cfg):
    """The compiled vocabulary-sized terms give the eager loss, metrics and gradients (up to float
    summation order), under bf16 autocast as training runs them and in fp32."""
    head = make_head(target)

    def run(compiled: bool, bf16: bool):
        head.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = loss_fn(head, batch, replace(cfg, compile=compiled), torch.Generator().manual_seed(3))
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in head.named_parameters()}

    for bf16 in (False, True):
        (eager, g_eager), (comp, g_comp) = run(False, bf16), run(True, bf16)
        assert torch.allclose(comp.loss, eager.loss, rtol=1e-5, atol=1e-6)
        for a, b in zip(comp.steps, eager.steps):
            for name in ("feature", "token", "distill", "count"):
                assert torch.allclose(getattr(a, name), getattr(b, name), rtol=1e-5, atol=1e-6), name
        for n in g_eager:
            assert torch.allclose(g_comp[n], g_eager[n], rtol=1e-4, atol=1e-6), n


def test_compile_without_a_compiler_is_refused(monkeypatch):
    import shutil

    from taps.train.trainer import TrainingError, require_compiler

    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(TrainingError, match="needs a C.. compiler"):
        require_compiler(torch.device("cpu"))
    require_compiler(torch.device("meta"))  # accelerators compile with Triton: nothing to check here
