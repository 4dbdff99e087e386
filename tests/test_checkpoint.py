"""The EAGLE head and its checkpoint: layout, round trip, strict loading with named errors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from taps.drafter.checkpoint import CheckpointError, DrafterInfo, init_head, load_head, save_head, write_untrained
from taps.target import Target

EXPECTED_KEYS = {
    "fc.weight",
    "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
    "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
    "layers.0.post_attention_layernorm.weight",
}


@pytest.fixture(scope="module")
def target(target_dir):
    return Target.load(target_dir, device="cpu", dtype="float32")


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
    loaded, info = load_head(path, target)
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
    with pytest.raises(CheckpointError, match="invalid JSON at line 3"):
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
    loaded, _ = load_head(out, target)
    assert loaded.fc.bias is not None


def test_write_untrained_for_target_dir(tmp_path, target_dir, target):
    out = write_untrained(target_dir, tmp_path / "init", seed=7)
    head, info = load_head(out, target)
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
        loaded, info = load_head(foreign, target)
    assert info.tokenizer_fingerprint is None
    assert torch.equal(loaded.fc.weight, head.fc.weight)
    assert loaded.config.rope_parameters["rope_theta"] == 10000.0
