"""The EAGLE-3 backbone: the head's layout (what the engines load), its checkpoint round trip and
strict checks, training-time test attention equal to drafting attention, lossless decoding
(greedy identity in float32 for three architectures, sampling distribution), and a trained head
that beats an untrained one end to end (regenerate, features with aux layers, train, decode)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import hf_greedy, prompts
from taps.core.config import DecodeConfig, TreeConfig
from taps.core.decode import generate
from taps.data.features import FeaturesError, FeatureSettings, extract_features
from taps.drafter.checkpoint import CheckpointError, DrafterInfo, init_head, load_head, save_head
from taps.drafter.context import consume
from taps.drafter.head3 import Eagle3Head, default_aux_layers
from taps.propose.single import SingleProposer
from taps.core.target import Target
from taps.core.testing import tiny_model
from taps.train.losses import Eagle3Config, aligned_outputs, eagle3_loss, head_pairs, pad_batch
from taps.core.tree import additive_mask

LAYERS = 8  # default aux layers of an 8-layer target: outputs of layers 1, 3 and 4


def target_of(arch="llama", seed=0, **kw):
    model = tiny_model(arch, seed=seed, layers=LAYERS, **kw)
    model.requires_grad_(False)
    return Target(model)


def eagle3_head(target, seed=1, draft_ids=None):
    n = None if draft_ids is None else int(draft_ids.numel())
    head = init_head(target.model.config, seed=seed, backbone="eagle3", draft_vocab_size=n)
    return head.set_draft_vocab(draft_ids).attach(target)


@pytest.fixture(scope="module")
def target():
    return target_of()


# ---- the layout ----------------------------------------------------------------------------------
def test_state_dict_is_the_engines_eagle3_layout(target):
    head = eagle3_head(target, draft_ids=torch.arange(0, 384, 2))
    h, n = target.hidden_size, 192
    shapes = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    heads, kv, dim = 4, 2, h // 4
    assert shapes == {
        "fc.weight": (h, 3 * h),
        "midlayer.self_attn.q_proj.weight": (heads * dim, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv * dim, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv * dim, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, heads * dim),
        "midlayer.mlp.gate_proj.weight": (128, h),
        "midlayer.mlp.up_proj.weight": (128, h),
        "midlayer.mlp.down_proj.weight": (h, 128),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (n, h),
    }
    assert head.aux_layers == default_aux_layers(LAYERS) == (1, 3, 4)
    assert head.feature_layers == (2, 4, 5)  # hidden_states indices: the output of layer L is hidden_states[L + 1]


def test_target_captures_the_aux_layers(target):
    eagle3_head(target)
    ids = torch.tensor([5, 9, 2, 7])
    target.reset()
    out = target.prefill(ids, all_logits=True)
    with torch.inference_mode():
        hs = target.model(ids[None], output_hidden_states=True).hidden_states
    h = target.hidden_size
    assert out.features.shape == (4, 4 * h)
    for block, index in enumerate((-1, 2, 4, 5)):
        torch.testing.assert_close(out.features[:, block * h:(block + 1) * h], hs[index][0])


def test_only_fused_width_inputs_go_through_fc(target):
    head = eagle3_head(target)
    tokens, pos = torch.tensor([[3, 4]]), torch.arange(2)[None]
    mask = additive_mask(torch.ones(2, 2, dtype=torch.bool).tril(), torch.arange(2), 0, None, torch.float32)
    layers = torch.randn(1, 2, 3 * target.hidden_size)
    with torch.no_grad():
        a = head(tokens, layers, pos, mask)
        b = head(tokens, head.fuse(layers), pos, mask)
    torch.testing.assert_close(a, b)


def test_eagle3_needs_attaching_before_decoding(target):
    head = init_head(target.model.config, seed=0, backbone="eagle3").bind(target.embed_tokens, target.lm_head)
    with pytest.raises(RuntimeError, match="attach"):
        head.select_features(torch.zeros(2, 4 * target.hidden_size))


def test_too_shallow_targets_need_named_layers():
    with pytest.raises(ValueError, match="name them"):
        init_head(tiny_model("llama", layers=2).config, backbone="eagle3")
    # one layer would make a target input and the head's own output the same width: refused
    with pytest.raises(ValueError, match="at least two"):
        init_head(tiny_model("llama", layers=LAYERS).config, backbone="eagle3", aux_layers=(2,))


# ---- checkpoints ---------------------------------------------------------------------------------
def test_checkpoint_round_trip_and_config_keys(target, tmp_path):
    head = eagle3_head(target, draft_ids=torch.arange(0, 384, 3))
    save_head(head, tmp_path / "h", DrafterInfo(backbone="eagle3", tokenizer_fingerprint=None))
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert config["draft_vocab_size"] == 128 and config["target_hidden_size"] == target.hidden_size
    loaded = load_head(tmp_path / "h", target)
    assert isinstance(loaded, Eagle3Head)
    for key, value in head.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    assert torch.equal(loaded.draft_ids, head.draft_ids)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 3, 7]), "distinct layer indices"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids="1,3,4"), "list of layer indices"),
    (lambda c: c.update(target_hidden_size=128), "target_hidden_size is 128"),
])
def test_checkpoint_refuses_what_does_not_fit_the_target(target, tmp_path, edit, message):
    save_head(eagle3_head(target), tmp_path / "h", DrafterInfo(backbone="eagle3"))
    path = tmp_path / "h" / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    config.pop("eagle_config")
    path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        load_head(tmp_path / "h", target)


def test_engine_default_layers_when_the_key_is_absent(target, tmp_path):
    save_head(eagle3_head(target), tmp_path / "h", DrafterInfo(backbone="eagle3"))
    path = tmp_path / "h" / "config.json"
    config = json.loads(path.read_text())
    config.pop("eagle_config"), config.pop("eagle_aux_hidden_state_layer_ids")
    path.write_text(json.dumps(config))
    assert load_head(tmp_path / "h", target).aux_layers == (1, 3, 4)


# ---- training-time test == drafting --------------------------------------------------------------
def batch_of(target, lengths=(14, 10)):
    samples = []
    h = target.hidden_size
    for seed, length in enumerate(lengths, start=1):
        ids = torch.randint(0, target.vocab_size, (length,), generator=torch.Generator().manual_seed(seed))
        target.reset()
        feats = target.prefill(ids, all_logits=True).features.clone()  # [T, 4H]: last, then the aux layers
        samples.append((ids, feats[:, :h], (torch.arange(length) >= 3).long(), feats[:, h:]))
    return pad_batch(samples)


def inference_chain(head, ids, feats, c, depth):
    """The head's outputs at depths 1..depth after c committed pairs, as the decoder drafts a chain:
    consume() the true context (fused layers), then feed each output back as the next input."""
    with torch.inference_mode():
        ctx = consume(head, None, ids[1:c + 1], feats[:c])
        outs, feat = [ctx.root_hidden.clone()], ctx.root_hidden
        anc = torch.zeros(1, 0, dtype=torch.bool)
        for level in range(2, depth + 1):
            anc = torch.cat([anc, torch.ones(1, 1, dtype=torch.bool)], dim=1)
            mask = additive_mask(anc, None, ctx.length, None, feat.dtype)
            positions = torch.full((1, 1), ctx.length + level - 2)
            feat = head(ids[c + level - 1].view(1, 1), feat.view(1, 1, -1), positions, mask, ctx.cache)[0, 0]
            outs.append(feat.clone())
    return outs


@pytest.mark.parametrize("steps", [3, 5])
def test_training_time_test_attention_equals_drafting(target, steps):
    head = eagle3_head(target, seed=2)
    batch = batch_of(target)
    pairs = head_pairs(batch)
    with torch.no_grad():
        train = aligned_outputs(head, pairs.tokens, head.fuse(pairs.features), pairs.positions, steps, detach=False)
    h = target.hidden_size
    worst = [0.0] * steps
    for b, length in enumerate(batch.lengths.tolist()):
        ids = batch.input_ids[b, :length]
        feats = torch.cat([batch.hidden[b, :length], batch.aux[b, :length]], dim=-1)  # the Target's layout
        assert feats.shape[-1] == 4 * h
        for c in range(1, length - 1):
            depth = min(steps, length - c)
            for d, inf in enumerate(inference_chain(head, ids, feats, c, depth), start=1):
                worst[d - 1] = max(worst[d - 1], float((train[d - 1][b, c + d - 2] - inf).abs().max()))
    assert max(worst) < 1e-5, worst


def test_loss_weights_steps_and_lets_gradients_through_steps(target):
    head = eagle3_head(target, seed=3, draft_ids=torch.arange(0, 384, 2))
    batch = batch_of(target)
    out = eagle3_loss(head, batch, Eagle3Config(steps=3, step_decay=0.5))
    expected = sum(0.5 ** j * s.token for j, s in enumerate(out.steps))
    torch.testing.assert_close(out.loss, expected)
    assert all(float(s.feature.detach()) > 0 for s in out.steps)  # computed, but no part of the loss
    # without detaching, step 2's loss reaches fc only through step 1's output as well: the
    # gradients differ from the detached variant's
    grads = {}
    for detach in (False, True):
        head.zero_grad()
        eagle3_loss(head, batch, Eagle3Config(steps=2, detach=detach)).loss.backward()
        grads[detach] = head.midlayer.mlp.down_proj.weight.grad.clone()
    assert not torch.allclose(grads[False], grads[True])
    with pytest.raises(ValueError, match="aux-layers"):
        eagle3_loss(head, pad_batch([(batch.input_ids[0], batch.hidden[0], batch.loss_mask[0])]))


def test_feature_weight_adds_step_one_regression_of_the_normed_output(target):
    """Eagle3Config.feature_weight (taps train --ttt-feature-weight): the first step's term gains
    W x SmoothL1(head.norm(step-1 output), true next feature); the deeper steps' terms are unchanged,
    and the gradient then reaches the head's norm through the regression as well."""
    head = eagle3_head(target, seed=5, draft_ids=torch.arange(0, 384, 2))
    batch = batch_of(target)
    plain = eagle3_loss(head, batch, Eagle3Config(steps=3, step_decay=0.5))
    out = eagle3_loss(head, batch, Eagle3Config(steps=3, step_decay=0.5, feature_weight=2.0))
    torch.testing.assert_close(out.loss, plain.loss + 2.0 * out.steps[0].feature)
    pairs = head_pairs(batch)
    with torch.no_grad():
        first = aligned_outputs(head, pairs.tokens, head.fuse(pairs.features), pairs.positions, 1, detach=False)[0]
        w = pairs.weight
        expected = torch.nn.functional.smooth_l1_loss(head.norm(first[w]), pairs.targets[w]).item()
    assert abs(float(out.steps[0].feature.detach()) - expected) < 1e-5 * max(1.0, expected)
    grads = []
    for cfg in (Eagle3Config(steps=2), Eagle3Config(steps=2, feature_weight=1.0)):
        head.zero_grad()
        eagle3_loss(head, batch, cfg).loss.backward()
        grads.append(head.norm.weight.grad.clone())
    assert not torch.allclose(grads[0], grads[1])
    with pytest.raises(ValueError, match="feature_weight"):
        Eagle3Config(feature_weight=-1.0)


def test_teacher_is_the_targets_lm_head_not_the_heads(target):
    """q comes from the target's LM head at the true feature: changing the head's own lm_head
    changes its logits but not the target distribution it is trained towards."""
    head = eagle3_head(target, seed=4)
    feat = torch.randn(3, target.hidden_size)
    before = head.target_logits(feat)
    with torch.no_grad():
        head.lm_head.weight.mul_(3.0)
    torch.testing.assert_close(head.target_logits(feat), before)
    torch.testing.assert_close(before, target.lm_head(feat))


# ---- lossless --------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("tree", [TreeConfig(60, 5, 10), TreeConfig(20, 6, 2)])
def test_greedy_is_lossless(arch, tree):
    target = target_of(arch, seed=1)
    head = eagle3_head(target, seed=5, draft_ids=torch.arange(0, 384, 3))
    for prompt in prompts(3, seed=7):
        reference = hf_greedy(target.model, prompt, 24)
        out = generate(target, SingleProposer(head, tree), prompt, DecodeConfig(max_new_tokens=24))
        assert out.tokens == reference


def test_sampling_keeps_the_target_distribution():
    from test_decode import check_second_token_distribution

    model = tiny_model("llama", seed=5, vocab_size=16, hidden_size=32, layers=4, heads=2, kv_heads=1, intermediate=64)

    def proposer(target):
        # an untrained head over the full vocabulary of 16 drafts often-accepted and often-rejected tokens
        head = init_head(model.config, seed=1, backbone="eagle3", aux_layers=(0, 1, 2)).attach(target)
        return SingleProposer(head, TreeConfig(12, 2, 4))

    n = 2000
    accepted = check_second_token_distribution(model, proposer, [3, 7, 1], n)
    assert 0 < accepted < n


# ---- end to end ------------------------------------------------------------------------------------
def test_features_refuse_bad_aux_layers(target_dir, tmp_path):
    tgt = Target.load(target_dir, device="cpu", dtype="float32")  # 2 layers: no default layers
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"id": "a", "conversations": [{"role": "user", "content": "hi"},
                                                             {"role": "assistant", "content": "ho"}]}) + "\n")
    with pytest.raises(FeaturesError, match="--aux-layers"):
        extract_features(tgt, data, tmp_path / "f", FeatureSettings(aux_layers="auto"), progress=None)
    with pytest.raises(FeaturesError, match="--aux-layers"):
        extract_features(tgt, data, tmp_path / "f", FeatureSettings(aux_layers="0,x"), progress=None)


# ---- compositions and chat -------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["merge-trie:a=A,b=B", "merge-budget:a=A,b=B", "route-confidence-step:a=A,b=B"])
def test_eagle2_and_eagle3_heads_compose_losslessly(tmp_path, spec):
    """One target serves both heads in one forward: the EAGLE-2 head reads the last layer, the
    EAGLE-3 head its three layers (loaded from disk, as `taps generate` / `serve` load them)."""
    from taps.propose.factory import HeadPool
    from taps.propose.spec import parse_variant

    target = target_of("llama", seed=2)
    save_head(init_head(target.model.config, seed=3), tmp_path / "a", DrafterInfo(backbone="eagle2"))
    save_head(eagle3_head(target, seed=4, draft_ids=torch.arange(0, 384, 2)), tmp_path / "b",
              DrafterInfo(backbone="eagle3"))
    target.feature_layers = (-1,)  # as loaded fresh: only load_head attaches
    pool = HeadPool(target)
    proposer = pool.proposer(parse_variant("v=" + spec.replace("A", str(tmp_path / "a")).replace("B", str(tmp_path / "b"))),
                             TreeConfig(30, 4, 4))
    assert target.feature_layers == (-1, 2, 4, 5)
    for prompt in prompts(2, seed=11):
        out = generate(target, proposer, prompt, DecodeConfig(max_new_tokens=20))
        assert out.tokens == hf_greedy(target.model, prompt, 20)


def test_chat_turn_after_a_head_attaches_re_encodes(tokenizer):
    """A session's first turn decoded before an EAGLE-3 head attached keeps features without its
    layers: the next turn re-encodes instead of reusing them, and stays lossless."""
    from taps.core.decode import ChatSession, Decoder

    model = tiny_model("qwen2", seed=0, layers=LAYERS)
    target = Target(model, tokenizer)
    cfg = DecodeConfig(max_new_tokens=12, stop_token_ids=target.stop_token_ids())
    chat = ChatSession(target, None, cfg)
    chat.send("How many clips did Natalia sell?")
    chat.decoder.proposer = SingleProposer(eagle3_head(target, seed=6), TreeConfig(20, 4, 4))
    _, second = chat.send("And in May?")
    assert second.reused_prefix == 0
    full = tokenizer(tokenizer.apply_chat_template(chat.messages[:3], tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
    assert Decoder(Target(model, tokenizer)).run(full, cfg).tokens == second.tokens


def test_init_from_target_starts_in_the_targets_output_space(target):
    """After init_from_target the head's own norm + LM head are the target's final norm and LM-head
    rows: its logits at a hidden state are the target's over the draft vocabulary."""
    ids = torch.arange(0, 384, 4)
    head = eagle3_head(target, seed=7, draft_ids=ids)
    hidden = torch.randn(5, target.hidden_size)
    with torch.no_grad():
        expected = target.lm_head(target.model.model.norm(hidden))[:, ids]
        assert not torch.allclose(head.logits(hidden), expected)
        head.init_from_target(target)
        torch.testing.assert_close(head.logits(hidden), expected)


def test_eagle3_heads_with_different_draft_vocabularies_average_over_their_union(target, tmp_path):
    """A family trains each head over its own data's most frequent tokens, so two EAGLE-3 heads'
    LM heads cover different tokens. The average drafts over the union of the vocabularies of the
    heads weighted above 0, a token's row the weighted average of the rows of the heads that have
    it (renormalised): no stand-in row for a head that lacks a token (a target row there made
    eagle3-math + eagle3-chat draft almost nothing). Bound or not, in memory or on disk, the same
    head; decoding with it stays lossless."""
    from taps.drafter.average import average_checkpoints, average_heads

    a_ids, b_ids = torch.arange(0, 300, 2), torch.arange(100, 384, 3)  # overlapping, different
    a = eagle3_head(target, seed=11, draft_ids=a_ids).init_from_target(target)
    b = eagle3_head(target, seed=12, draft_ids=b_ids).init_from_target(target)
    with torch.no_grad():
        for head, scale in ((a, 1.5), (b, 0.5)):  # "trained": rows that differ from the target's
            head.lm_head.weight.mul_(scale)
    avg = average_heads([a, b], [0.25, 0.75])
    union = torch.unique(torch.cat([a_ids, b_ids]))
    assert torch.equal(avg.draft_ids.cpu(), union) and avg.lm_head.weight.shape[0] == union.numel()
    rows = dict(zip(union.tolist(), avg.lm_head.weight))
    only_a, only_b, both = 0, 382, int(a_ids[torch.isin(a_ids, b_ids)][0])
    assert only_a not in b_ids and only_b not in a_ids and only_b in b_ids
    torch.testing.assert_close(rows[only_a], a.lm_head.weight[0])  # a's row, not mixed with the target's
    torch.testing.assert_close(rows[only_b], b.lm_head.weight[-1])
    assert not torch.allclose(rows[only_a], 0.25 * a.lm_head.weight[0] + 0.75 * target.lm_head.weight[only_a])
    ia, ib = int((a_ids == both).nonzero()), int((b_ids == both).nonzero())
    torch.testing.assert_close(rows[both], 0.25 * a.lm_head.weight[ia] + 0.75 * b.lm_head.weight[ib])
    torch.testing.assert_close(avg.midlayer.self_attn.q_proj.weight,
                               0.25 * a.midlayer.self_attn.q_proj.weight + 0.75 * b.midlayer.self_attn.q_proj.weight)
    whole_a = average_heads([a, b], [1.0, 0.0])  # all of a: b adds nothing, its tokens included
    assert torch.equal(whole_a.draft_ids.cpu(), a_ids)
    hidden = torch.randn(3, target.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(whole_a.logits(hidden), a.logits(hidden))
    for prompt in prompts(2, seed=4):
        out = generate(target, SingleProposer(avg, TreeConfig(20, 4, 4)), prompt, DecodeConfig(max_new_tokens=20))
        assert out.tokens == hf_greedy(target.model, prompt, 20)
    unbound = [init_head(target.model.config, seed=s, backbone="eagle3", draft_vocab_size=ids.numel()).set_draft_vocab(ids)
               for s, ids in ((1, a_ids), (2, b_ids))]
    assert torch.equal(average_heads(unbound).draft_ids.cpu(), union)  # no target needed
    for name, head in (("a", a), ("b", b)):  # on disk (`taps average`): the same rows and vocabulary
        save_head(head, tmp_path / name, DrafterInfo(backbone="eagle3"))
    average_checkpoints([tmp_path / "a", tmp_path / "b"], tmp_path / "avg", [0.25, 0.75])
    loaded = load_head(tmp_path / "avg", target)
    assert torch.equal(loaded.draft_ids.cpu(), union)
    torch.testing.assert_close(loaded.lm_head.weight, avg.lm_head.weight)
    torch.testing.assert_close(loaded.fc.weight, avg.fc.weight)


def test_averaging_and_reducing_refuse_eagle3_heads_where_they_cannot_work(target, tmp_path):
    """Averaging stays within one backbone, on disk too, and an EAGLE-3 head in vLLM's naming (no
    Eagle3 architecture, only its midlayer tensors) is still known as one; reduce-vocab refuses it."""
    import os

    from taps.drafter.average import AverageError, average_checkpoints
    from taps.train.draft_vocab import reduce_vocab

    save_head(init_head(target.model.config, seed=1), tmp_path / "e2", DrafterInfo(backbone="eagle2"))
    save_head(eagle3_head(target, seed=2), tmp_path / "e3", DrafterInfo(backbone="eagle3"))
    assert (os.stat(tmp_path / "e3" / "model.safetensors").st_mode & 0o044) == 0o044  # readable by other users
    path = tmp_path / "e3" / "config.json"
    config = json.loads(path.read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    path.write_text(json.dumps(config))
    with pytest.raises(AverageError, match="within one backbone"):
        average_checkpoints([tmp_path / "e2", tmp_path / "e3"], tmp_path / "avg")
    with pytest.raises(ValueError, match="EAGLE-3 head's own LM head"):
        reduce_vocab(tmp_path / "e3", [str(tmp_path)], 16, tmp_path / "red")
