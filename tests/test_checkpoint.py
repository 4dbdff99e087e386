"""The EAGLE head and its checkpoint: layout, round trip, strict loading with named errors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from taps.drafter.checkpoint import (CheckpointError, DrafterInfo, init_head, load_head, read_config, save_head,
                                     write_untrained)

EXPECTED_KEYS = {
    "fc.weight",
    "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
    "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
    "layers.0.post_attention_layernorm.weight",
}


@pytest.fixture
def saved(tmp_path, target):
    head = init_head(target.model.config, seed=3)
    info = DrafterInfo(backbone="eagle2", training_data="unit-test", target_name="tiny",
                       tokenizer_fingerprint=target.fingerprint())
    return save_head(head, tmp_path / "head", info), head


def test_layout_matches_eagle(saved, target):
    path, head = saved
    tensors = load_file(path / "model.safetensors")
    assert set(tensors) == EXPECTED_KEYS  # no input_layernorm, no final norm, no embedding, no lm_head
    h = target.hidden_size
    assert tensors["fc.weight"].shape == (h, 2 * h)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle"]
    assert config["num_hidden_layers"] == 1 and config["bias"] is False
    assert config["hidden_size"] == h and config["vocab_size"] == target.vocab_size
    assert "rope_theta" in config
    assert config["taps"]["backbone"] == "eagle2"
    assert config["taps"]["tokenizer_fingerprint"] == target.fingerprint()


def test_round_trip_and_shared_embedding(saved, target):
    path, head = saved
    loaded = load_head(path, target)
    _, info = read_config(path)
    assert info.training_data == "unit-test"
    for key, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    # The target's embedding and LM head are used by reference, never copied or registered.
    embed, lm_head = loaded.shared
    assert embed is target.embed_tokens and lm_head is target.lm_head
    names = {n for n, _ in loaded.named_parameters()}
    assert not any("embed" in n or "lm_head" in n for n in names)
    # And it computes: same outputs as the original head, bound to the same target.
    head.bind(target.embed_tokens, target.lm_head)
    feats = torch.randn(1, 4, target.hidden_size)
    toks = torch.tensor([[1, 2, 3, 4]])
    pos = torch.arange(4)[None]
    mask = torch.zeros(1, 1, 4, 4).masked_fill(~torch.ones(4, 4, dtype=torch.bool).tril(), torch.finfo(torch.float32).min)
    with torch.inference_mode():
        assert torch.equal(head(toks, feats, pos, mask), loaded(toks, feats, pos, mask))


def test_init_is_seeded(target):
    a, b, c = (init_head(target.model.config, seed=s) for s in (1, 1, 2))
    assert torch.equal(a.fc.weight, b.fc.weight) and not torch.equal(a.fc.weight, c.fc.weight)


def rewrite(path, mutate_tensors=None, mutate_config=None):
    if mutate_tensors:
        tensors = load_file(path / "model.safetensors")
        mutate_tensors(tensors)
        save_file(tensors, path / "model.safetensors")
    if mutate_config:
        config = json.loads((path / "config.json").read_text())
        mutate_config(config)
        (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("mutation, message", [
    (dict(mutate_tensors=lambda t: t.pop("layers.0.mlp.up_proj.weight")), "missing key.*layers.0.mlp.up_proj.weight"),
    (dict(mutate_tensors=lambda t: t.update({"layers.0.input_layernorm.weight": torch.ones(64)})),
     "unexpected key.*layers.0.input_layernorm.weight"),
    (dict(mutate_tensors=lambda t: t.update({"fc.weight": torch.zeros(64, 64)})),
     r"fc.weight has shape \(64, 64\), expected \(64, 128\)"),
    (dict(mutate_config=lambda c: c.update(vocab_size=1000)), "vocab_size is 1000"),
    (dict(mutate_config=lambda c: c.update(hidden_size=128)), "hidden_size is 128"),
    (dict(mutate_config=lambda c: c["taps"].update(tokenizer_fingerprint="sha256:0000")),
     "tokenizer_fingerprint sha256:0000 does not match"),
    (dict(mutate_config=lambda c: c.update(num_hidden_layers=2)), "num_hidden_layers is 2"),
    (dict(mutate_config=lambda c: c.pop("intermediate_size")), "'intermediate_size' is missing"),
])
def test_strict_load_errors_name_the_problem(saved, target, mutation, message):
    path, _ = saved
    rewrite(path, **mutation)
    with pytest.raises(CheckpointError, match=message):
        load_head(path, target)


def test_missing_files_and_bad_json(saved, target):
    path, _ = saved
    (path / "config.json").write_text("{\n  \"hidden_size\": 64,\n  oops\n}")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON \(.* at line 3, column 3\)"):
        load_head(path, target)
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: missing"):
        load_head(path, target)


def test_pickle_weights_refused(saved, target):
    path, _ = saved
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="safetensors only"):
        load_head(path, target)


def test_foreign_embedding_ignored_and_fc_bias_export(tmp_path, saved, target):
    path, head = saved
    rewrite(path, mutate_tensors=lambda t: t.update({"embed_tokens.weight": torch.zeros(target.vocab_size, 64)}))
    load_head(path, target)  # the published EAGLE heads carry an embedding: it is ignored
    out = save_head(head, tmp_path / "sglang", DrafterInfo(tokenizer_fingerprint=target.fingerprint()),
                    export_fc_bias=True)
    tensors = load_file(out / "model.safetensors")
    assert torch.equal(tensors["fc.bias"], torch.zeros(64))
    loaded = load_head(out, target)
    assert loaded.fc.bias is not None


def test_write_untrained_for_target_dir(tmp_path, target_dir, target):
    out = write_untrained(target_dir, tmp_path / "init", seed=7)
    head = load_head(out, target)
    _, info = read_config(out)
    assert info.backbone == "untrained" and info.tokenizer_fingerprint == target.fingerprint()
    assert torch.equal(head.fc.weight, init_head(target.model.config, seed=7).fc.weight)


def test_foreign_eagle_checkpoint_loads(tmp_path, saved, target):
    """A head as the EAGLE authors publish it: transformers-4.x style config (top-level rope_theta,
    rope_scaling, token ids, no taps block) and an embed_tokens tensor."""
    path, head = saved
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "bos_token_id": 128000, "eos_token_id": 128001,
              "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
              "max_position_embeddings": 512, "model_type": "llama", "num_attention_heads": 4,
              "num_hidden_layers": 1, "num_key_value_heads": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-6,
              "rope_scaling": None, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float16",
              "transformers_version": "4.28.1", "use_cache": True, "vocab_size": target.vocab_size}
    (foreign / "config.json").write_text(json.dumps(config))
    tensors = load_file(path / "model.safetensors")
    tensors["embed_tokens.weight"] = torch.zeros(target.vocab_size, 64)
    save_file(tensors, foreign / "model.safetensors")
    with pytest.warns(UserWarning, match="no taps.tokenizer_fingerprint"):
        loaded = load_head(foreign, target)
        _, info = read_config(foreign)
    assert info.tokenizer_fingerprint is None
    assert torch.equal(loaded.fc.weight, head.fc.weight)
    assert loaded.config.rope_parameters["rope_theta"] == 10000.0


# ---- a draft vocabulary (EAGLE-3 / SGLang): draft_vocab_size + d2t + t2d -----------------------------
DRAFT_IDS = torch.tensor([0, 3, 4, 10, 57, 200, 383])


@pytest.fixture
def saved_reduced(tmp_path, target):
    head = init_head(target.model.config, seed=3).set_draft_vocab(DRAFT_IDS)
    info = DrafterInfo(backbone="eagle2", tokenizer_fingerprint=target.fingerprint(),
                       extra={"draft_vocab_coverage": 0.75})
    return save_head(head, tmp_path / "reduced", info), head


def test_draft_vocab_logits_are_the_lm_head_rows(target):
    head = init_head(target.model.config, seed=3).bind(target.embed_tokens, target.lm_head)
    hidden = torch.randn(2, 5, target.hidden_size)
    with torch.inference_mode():
        full = head.logits(hidden)  # [2, 5, V]
        assert torch.equal(full, target.lm_head(hidden))  # without a draft vocabulary: the LM head, as before
    head.set_draft_vocab(DRAFT_IDS)
    with torch.inference_mode():
        reduced = head.logits(hidden)  # [2, 5, N]
    assert reduced.shape == (2, 5, len(DRAFT_IDS))
    assert torch.allclose(reduced, full[..., DRAFT_IDS], atol=1e-6)
    assert torch.equal(head.to_target_ids(torch.tensor([[0, 6], [2, 1]])), torch.tensor([[0, 383], [4, 3]]))
    assert head.draft_vocab_size == len(DRAFT_IDS)
    # the rows are sliced once (outside inference mode: a training step may use them), again after a bind
    rows = head._draft_rows[1].weight
    assert not rows.is_inference() and not rows.requires_grad
    head.logits(hidden)
    assert head._draft_rows[1].weight is rows
    head.bind(target.embed_tokens, target.lm_head)
    head.logits(hidden)
    assert head._draft_rows[1].weight is not rows
    # the mapping is not a parameter and not in state_dict (the checkpoint writes d2t / t2d instead)
    assert set(head.state_dict()) == EXPECTED_KEYS and "draft_ids" not in dict(head.named_parameters())
    for bad, message in [(torch.tensor([4, 3]), "sorted ascending"), (torch.tensor([3, 3]), "distinct"),
                         (torch.tensor([0, 384]), r"in \[0, 384\)"), (torch.tensor([]), "non-empty")]:
        with pytest.raises(ValueError, match=message):
            head.set_draft_vocab(bad)
    assert head.set_draft_vocab(None).draft_ids is None and head.logits(hidden).shape[-1] == target.vocab_size


def test_draft_vocab_round_trip_in_sglang_form(saved_reduced, target):
    path, head = saved_reduced
    tensors = load_file(path / "model.safetensors")
    assert set(tensors) == EXPECTED_KEYS | {"d2t", "t2d"}
    n = len(DRAFT_IDS)
    assert tensors["d2t"].dtype == torch.int64 and tensors["d2t"].tolist() == (DRAFT_IDS - torch.arange(n)).tolist()
    assert tensors["d2t"].tolist() == [0, 2, 2, 7, 53, 195, 377]  # target id = d2t[i] + i (SGLang's hot_token_id)
    assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].shape == (target.vocab_size,)
    assert tensors["t2d"].nonzero().flatten().tolist() == DRAFT_IDS.tolist()
    config = json.loads((path / "config.json").read_text())
    assert config["draft_vocab_size"] == n and config["vocab_size"] == target.vocab_size
    assert config["taps"]["draft_vocab_coverage"] == 0.75
    loaded = load_head(path, target)
    _, info = read_config(path)
    assert torch.equal(loaded.draft_ids, DRAFT_IDS) and info.extra["draft_vocab_coverage"] == 0.75
    for key, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    # a full-vocabulary head saved again has none of it
    plain = save_head(loaded.set_draft_vocab(None), path.parent / "plain", info)
    assert "draft_vocab_size" not in json.loads((plain / "config.json").read_text())
    assert set(load_file(plain / "model.safetensors")) == EXPECTED_KEYS


def _flip(t2d, i):
    t2d = t2d.clone()
    t2d[i] = ~t2d[i]
    return t2d


def _tensors(**changes):
    return dict(mutate_tensors=lambda t: t.update({k: f(t[k]) for k, f in changes.items()}))


def _config(**values):
    return dict(mutate_config=lambda c: c.update(values))


@pytest.mark.parametrize("mutation, message", [
    (dict(mutate_tensors=lambda t: t.pop("d2t")), r"missing key\(s\) d2t \(config.json has draft_vocab_size 7\)"),
    (dict(mutate_tensors=lambda t: t.pop("t2d")), r"missing key\(s\) t2d"),
    (_tensors(d2t=lambda d: d[:-1]), r"key d2t is torch.int64 \(6,\), expected int64 \(7,\)"),
    (_tensors(d2t=lambda d: d.float()), "key d2t is torch.float32"),
    (_tensors(d2t=lambda d: d.flip(0)), "key d2t: the target ids .* distinct and ascending"),
    (_tensors(d2t=lambda d: d + 10), r"key d2t maps draft indices to target ids .* outside \[0, 384\)"),
    (_tensors(t2d=lambda m: _flip(m, 5)), "key t2d does not mark exactly the 7 target ids"),
    (_tensors(t2d=lambda m: _flip(_flip(m, 4), 5)), "key t2d does not mark exactly"),
    (_tensors(t2d=lambda m: m[:-1]), r"key t2d is torch.bool \(383,\), expected bool \(384,\)"),
    (_tensors(t2d=lambda m: m.to(torch.uint8)), "key t2d is torch.uint8"),
    (_config(draft_vocab_size=385), r"draft_vocab_size is 385, expected an integer in \[1, vocab_size 384\]"),
    (_config(draft_vocab_size=8), r"key d2t is torch.int64 \(7,\), expected int64 \(8,\)"),
    (dict(mutate_config=lambda c: c.pop("draft_vocab_size")), r"unexpected key\(s\) d2t, t2d"),
])
def test_draft_vocab_strict_load_errors_name_the_key(saved_reduced, target, mutation, message):
    path, _ = saved_reduced
    rewrite(path, **mutation)
    with pytest.raises(CheckpointError, match=message):
        load_head(path, target)
