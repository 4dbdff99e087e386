"""`taps export` and the engines' layouts read back: export -> import round trips per engine and
backbone (greedy output identical to plain greedy in float32, acceptance within noise), the
refusals, the provenance record, and the foreign layouts load_head reads.

What each engine's loader reads is pinned in tests/test_engine_contracts.py; here the question is
whether TAPS itself decodes the same with the exported head as with the original.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import cached_model, hf_greedy
from taps.cli.main import main
from taps.core.config import DecodeConfig, TreeConfig
from taps.core.decode import generate
from taps.drafter.checkpoint import CheckpointError, DrafterInfo, init_head, load_head, save_head, weights_digest
from taps.drafter.export import export_head
from taps.drafter.fit import fit_linear_head, greedy_sequences
from taps.drafter.layouts import EAGLE_KEYS, EXPORT_RECORD, TOKEN_MAP_NAME, ExportError
from taps.core.outputs import OutputError
from taps.propose.single import SingleProposer
from taps.core.target import Target

NEW = 32
TREE = TreeConfig(60, 5, 10)
# Per-prompt acceptance lengths of these heads spread by about +-0.3 around ~2.3 (6 prompts): a
# difference in mean acceptance under 10% is noise; an export that lost weights drafts at ~1.0.
NOISE = 0.10


@pytest.fixture(scope="module")
def setting():
    """The tiny Llama as a Target, a head fitted on its greedy continuations with a draft
    vocabulary of the 64 tokens most frequent there, and in-distribution prompts."""
    model = cached_model("llama")
    target = Target(model)
    g = torch.Generator().manual_seed(1)
    seqs = greedy_sequences(target, torch.randint(0, model.config.vocab_size, (12, 6), generator=g).tolist(), 32)
    counts = torch.bincount(seqs[:, 6:].flatten(), minlength=model.config.vocab_size)  # [V]
    ids = torch.sort(counts, descending=True, stable=True).indices[:64].sort().values  # [64]
    head = fit_linear_head(target, seqs, seed=3).set_draft_vocab(ids)
    return model, target, head, ids, seqs[:6, :6].tolist()


def _saved(tmp_path, setting, backbone: str):
    _, target, head, _, _ = setting
    info = DrafterInfo(backbone=backbone, training_data="unit-test", target_name="tiny",
                       tokenizer_fingerprint=target.fingerprint())
    return save_head(head, tmp_path / f"{backbone}-head", info)


def _decode(target, head, prompts):
    results = [generate(target, SingleProposer(head, TREE), p, DecodeConfig(max_new_tokens=NEW)) for p in prompts]
    return [r.tokens for r in results], [r.acceptance_length for r in results], [[s.accepted for s in r.steps]
                                                                                for r in results]


@pytest.mark.parametrize("backbone", ["eagle2", "hass"])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_export_import_round_trip(tmp_path, setting, engine, backbone):
    model, target, head, ids, prompts = setting
    src = _saved(tmp_path, setting, backbone)
    done = export_head(src, engine, tmp_path / engine)
    out = done.out
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(out / "model.safetensors")
    record = json.loads((out / EXPORT_RECORD).read_text())
    assert record["backbone"] == backbone and record["engine"] == engine and record["head"] == src.name
    assert record["weights_sha256"] == weights_digest(src)
    assert config["taps"]["exported"]["weights_sha256"] == weights_digest(src)
    assert "draft_vocab_size" not in config and "d2t" not in tensors and "t2d" not in tensors
    if engine == "sglang":
        assert config["architectures"] == ["LlamaForCausalLMEagle"] and config["bias"] is True
        assert set(tensors) == set(EAGLE_KEYS) | {"fc.bias"} and not tensors["fc.bias"].any()
        assert torch.load(out / TOKEN_MAP_NAME, weights_only=True) == ids.tolist()
    else:
        assert config["architectures"] == ["LlamaForCausalLM"] and config["bias"] is False
        assert set(tensors) == set(EAGLE_KEYS) and not (out / TOKEN_MAP_NAME).exists()
        assert "full vocabulary" in done.draft_vocab and "64" in done.draft_vocab

    loaded = load_head(out, target)
    for key, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    if engine == "sglang":
        assert torch.equal(loaded.draft_ids, ids)  # the token map is the draft vocabulary again
    else:
        assert loaded.draft_ids is None  # what vLLM drafts over: the whole vocabulary

    tokens, acceptance, accepted = _decode(target, head, prompts)
    tokens_x, acceptance_x, accepted_x = _decode(target, loaded, prompts)
    for prompt, got, got_x in zip(prompts, tokens, tokens_x):
        assert got == got_x == hf_greedy(model, prompt, NEW)  # lossless, and the same text
    mean, mean_x = sum(acceptance) / len(acceptance), sum(acceptance_x) / len(acceptance_x)
    assert mean > 1.5  # the head drafts: a round trip that lost its weights would show here
    assert abs(mean_x - mean) <= NOISE * mean, (mean, mean_x)
    if engine == "sglang":
        assert accepted_x == accepted  # same weights, same vocabulary: the same steps


def test_llama_cpp_refuses_eagle2_and_hass_in_one_line(tmp_path, setting, capsys):
    for backbone in ("eagle2", "hass"):
        src = _saved(tmp_path, setting, backbone)
        with pytest.raises(ExportError, match="llama.cpp has no EAGLE-2 / HASS path"):
            export_head(src, "llama.cpp", tmp_path / "lcpp")
        assert main(["export", str(src), "--engine", "llama.cpp", "--out", str(tmp_path / "lcpp")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(src) in err and "EAGLE-3" in err
    assert not (tmp_path / "lcpp" / "model.safetensors").exists()


def test_fc_bias_rules(tmp_path, setting):
    """SGLang always builds fc with a bias: a head without one gets zeros (tested above). vLLM builds
    none: a zero bias is dropped, a non-zero one is refused (it would be silently lost)."""
    _, target, head, _, _ = setting
    info = DrafterInfo(backbone="eagle2", tokenizer_fingerprint=target.fingerprint())
    zero = save_head(head, tmp_path / "zero", info, export_fc_bias=True)
    assert "fc.bias" in load_file(zero / "model.safetensors")
    out = export_head(zero, "vllm", tmp_path / "vllm-zero").out
    assert "fc.bias" not in load_file(out / "model.safetensors")
    assert json.loads((out / "config.json").read_text())["bias"] is False
    tensors = load_file(zero / "model.safetensors")
    tensors["fc.bias"] = torch.full_like(tensors["fc.bias"], 0.5)
    save_file(tensors, zero / "model.safetensors")
    with pytest.raises(ExportError, match="builds fc without a bias, and this head's fc.bias is not zero"):
        export_head(zero, "vllm", tmp_path / "vllm-biased")
    sglang = export_head(zero, "sglang", tmp_path / "sglang-biased").out
    assert torch.equal(load_file(sglang / "model.safetensors")["fc.bias"], tensors["fc.bias"])
    assert load_head(sglang, target).fc.bias.eq(0.5).all()


def test_export_refusals_name_the_problem(tmp_path, setting):
    src = _saved(tmp_path, setting, "eagle2")
    with pytest.raises(OutputError, match="is also the input HEAD"):
        export_head(src, "vllm", src, force=True)
    export_head(src, "vllm", tmp_path / "once")
    with pytest.raises(OutputError, match="holds a drafter already; pass --force"):
        export_head(src, "sglang", tmp_path / "once")
    config = json.loads((src / "config.json").read_text())
    config["taps"]["backbone"] = "medusa"
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="backbone 'medusa' is not one TAPS exports"):
        export_head(src, "sglang", tmp_path / "x")
    config["taps"]["backbone"] = "eagle3"  # says eagle3, holds an EAGLE-2 network
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="its backbone is eagle3 but its tensors are an? eagle head"):
        export_head(src, "sglang", tmp_path / "x")


def test_rerun_for_another_engine_leaves_no_stale_token_map(tmp_path, setting):
    src = _saved(tmp_path, setting, "eagle2")
    export_head(src, "sglang", tmp_path / "out")
    assert (tmp_path / "out" / TOKEN_MAP_NAME).exists()
    export_head(src, "vllm", tmp_path / "out", force=True)
    assert not (tmp_path / "out" / TOKEN_MAP_NAME).exists()


# ---- foreign layouts load_head reads -----------------------------------------------------------
def test_vllm_speculators_names_and_model_prefix_load(tmp_path, setting):
    _, target, head, _, _ = setting
    src = _saved(tmp_path, setting, "eagle2")
    tensors = load_file(src / "model.safetensors")
    renamed = {("fusion_fc.weight" if k == "fc.weight" else f"model.{k}" if k.startswith("layers.") else k): v
               for k, v in tensors.items()}
    save_file(renamed, src / "model.safetensors")
    loaded = load_head(src, target)
    assert torch.equal(loaded.fc.weight, head.fc.weight)
    assert torch.equal(loaded.layers[0].mlp.up_proj.weight, head.layers[0].mlp.up_proj.weight)


@pytest.mark.parametrize("change, message", [
    (lambda c, t: c.update(architectures=["MedusaModel"]), r"architectures \['MedusaModel'\] is not an EAGLE head"),
    # an EAGLE-2 network named EAGLE-3, or with one EAGLE-3 tensor: read as EAGLE-3, strictly
    # (on this 2-layer target no EAGLE-3 head fits: one captured layer would make a target input and
    # the head's own output the same width, so the layer list is what is refused)
    (lambda c, t: c.update(architectures=["LlamaForCausalLMEagle3"], eagle_aux_hidden_state_layer_ids=[0]),
     r"eagle_aux_hidden_state_layer_ids must be a list of layer indices \(at least two\), got \[0\]"),
    (lambda c, t: (c.update(eagle_aux_hidden_state_layer_ids=[0]), t.update({"midlayer.hidden_norm.weight": torch.ones(64)})),
     r"eagle_aux_hidden_state_layer_ids must be a list of layer indices \(at least two\), got \[0\]"),
    (lambda c, t: t.update({"fusion_fc.weight": t["fc.weight"].clone()}), "key fc.weight appears twice"),
    (lambda c, t: t.update({"model.fc.weight": t["fc.weight"].clone()}), r"unexpected key\(s\) model.fc.weight"),
])
def test_foreign_layout_errors_name_the_problem(tmp_path, setting, change, message):
    _, target, _, _, _ = setting
    src = _saved(tmp_path, setting, "eagle2")
    config = json.loads((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    change(config, tensors)
    (src / "config.json").write_text(json.dumps(config))
    save_file(tensors, src / "model.safetensors")
    with pytest.raises(CheckpointError, match=message):
        load_head(src, target)


@pytest.mark.parametrize("token_map, message", [
    ([3, 3, 5], "must be distinct"),
    ([0, 384], r"outside \[0, 384\)"),
    ([[1, 2]], "expected a non-empty 1-D list"),
    ([], "expected a non-empty 1-D list"),
])
def test_bad_token_map_is_refused(tmp_path, setting, token_map, message):
    _, target, _, _, _ = setting
    out = export_head(_saved(tmp_path, setting, "eagle2"), "sglang", tmp_path / "sglang").out
    torch.save(token_map, out / TOKEN_MAP_NAME)
    with pytest.raises(CheckpointError, match=message):
        load_head(out, target)
    (out / TOKEN_MAP_NAME).write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="not a readable token map"):
        load_head(out, target)


def test_unsorted_token_map_is_the_same_vocabulary(tmp_path, setting):
    _, target, _, ids, _ = setting
    out = export_head(_saved(tmp_path, setting, "eagle2"), "sglang", tmp_path / "sglang").out
    torch.save(ids.flip(0).tolist(), out / TOKEN_MAP_NAME)  # SGLang takes any order
    assert torch.equal(load_head(out, target).draft_ids, ids)


# ---- EAGLE-3 heads (drafter/head3.py) ----------------------------------------------------------
@pytest.fixture(scope="module")
def eagle3_setting():
    """An 8-layer tiny Llama (EAGLE-3 reads layers 1, 3 and 4 of it by default) and an EAGLE-3 head
    drafting over every third token."""
    from taps.core.testing import tiny_model
    model = tiny_model("llama", seed=0, layers=8)
    model.requires_grad_(False)
    target = Target(model)
    ids = torch.arange(0, 384, 3)
    head = init_head(model.config, seed=1, backbone="eagle3", draft_vocab_size=int(ids.numel()))
    return model, target, head.set_draft_vocab(ids).attach(target), ids


@pytest.mark.parametrize("engine", ["sglang", "vllm", "llama.cpp"])
def test_eagle3_export_import_round_trip(tmp_path, eagle3_setting, engine):
    """Every engine takes an EAGLE-3 head with its draft vocabulary, so the round trip is exact:
    the same weights, vocabulary and captured layers (numbered the engine's way in the export,
    TAPS's way again once loaded), the same greedy steps, lossless."""
    model, target, head, ids = eagle3_setting
    src = save_head(head, tmp_path / "eagle3-head", DrafterInfo(backbone="eagle3", tokenizer_fingerprint=None))
    out = export_head(src, engine, tmp_path / engine).out
    config = json.loads((out / "config.json").read_text())
    shift = 0 if engine == "sglang" else 1
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + shift for i in head.aux_layers]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i + shift for i in head.aux_layers]
    loaded = load_head(out, target)
    assert loaded.aux_layers == head.aux_layers and torch.equal(loaded.draft_ids, ids)
    for key, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    head.attach(target)  # the target captures the layers of the head last attached: the same ones
    for prompt in ([5, 9, 2, 7, 11], [3, 1, 4, 1, 5, 9, 2, 6]):
        a = generate(target, SingleProposer(head, TREE), prompt, DecodeConfig(max_new_tokens=NEW))
        b = generate(target, SingleProposer(loaded, TREE), prompt, DecodeConfig(max_new_tokens=NEW))
        assert a.tokens == b.tokens == hf_greedy(model, prompt, NEW)
        assert [s.accepted for s in a.steps] == [s.accepted for s in b.steps]


def test_eagle3_full_vocabulary_head(tmp_path, eagle3_setting):
    """A head over the whole vocabulary: SGLang and llama.cpp get draft_vocab_size = V (llama.cpp's
    converter detects EAGLE-3 by that key); vLLM gets no d2t (it builds none when N = V)."""
    model, target, _, _ = eagle3_setting
    head = init_head(model.config, seed=2, backbone="eagle3").attach(target)
    src = save_head(head, tmp_path / "full", DrafterInfo(backbone="eagle3"))
    sglang = export_head(src, "sglang", tmp_path / "sglang").out
    assert json.loads((sglang / "config.json").read_text())["draft_vocab_size"] == 384
    assert not load_file(sglang / "model.safetensors")["d2t"].any()
    vllm = export_head(src, "vllm", tmp_path / "vllm").out
    assert "draft_vocab_size" not in json.loads((vllm / "config.json").read_text())
    assert "d2t" not in load_file(vllm / "model.safetensors")
    for out in (sglang, vllm):
        loaded = load_head(out, target)
        assert torch.equal(loaded.lm_head.weight, head.lm_head.weight)


def test_an_export_is_not_exported_again(tmp_path, eagle3_setting):
    _, _, head, _ = eagle3_setting
    src = save_head(head, tmp_path / "h", DrafterInfo(backbone="eagle3"))
    out = export_head(src, "vllm", tmp_path / "vllm").out
    with pytest.raises(ExportError, match="already an export for vllm; export the TAPS head it came from"):
        export_head(out, "llama.cpp", tmp_path / "again")


def test_exports_compose_in_taps_generate(tmp_path, target_dir, capsys):
    """The engines' layouts are drafters like any other: `taps generate` merges an SGLang export
    with a vLLM export of another head (the same load path serves `taps eval` and `taps serve`:
    propose/factory.load_member -> load_head), and greedy output is plain decoding's."""
    from taps.drafter.checkpoint import init_head as init
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(target_dir)
    heads = []
    for seed, engine in ((3, "sglang"), (4, "vllm")):
        head = init(config, seed=seed).set_draft_vocab(torch.arange(0, 384, 2))
        src = save_head(head, tmp_path / f"h{seed}", DrafterInfo(backbone="hass"))
        heads.append(f"{engine}={export_head(src, engine, tmp_path / engine).out}")
    common = ["generate", "--target", str(target_dir), "--prompt-ids", "30,31,32,33", "--max-new-tokens", "12",
              "--device", "cpu", "--dtype", "float32", "--json"]
    assert main(common) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(common + ["--drafter", heads[0], "--drafter", heads[1], "--strategy", "merge"]) == 0
    merged = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert merged["token_ids"] == plain["token_ids"] and len(plain["token_ids"]) == 12


def test_untrained_heads_export_by_their_tensors(tmp_path, eagle3_setting, setting):
    _, _, head3, _ = eagle3_setting
    _, _, head, _, _ = setting
    three = save_head(head3, tmp_path / "u3", DrafterInfo(backbone="untrained"))
    two = save_head(head, tmp_path / "u2", DrafterInfo(backbone="untrained"))
    assert export_head(three, "llama.cpp", tmp_path / "x3").family == "eagle3"
    assert export_head(two, "vllm", tmp_path / "x2").family == "eagle"
    with pytest.raises(ExportError, match="this untrained head cannot be exported for llama.cpp"):
        export_head(two, "llama.cpp", tmp_path / "x2b")


@pytest.mark.slow
def test_every_shipped_head_exports_and_round_trips(tmp_path):
    """The thirteen shipped heads, exported for SGLang and vLLM and loaded back against the real
    target in float32: the same weights, greedy output identical to plain decoding on a math and a
    chat prompt, and acceptance within noise of the original head (SGLang's export keeps the draft
    vocabulary, so its steps are the original's; vLLM's drafts over the whole vocabulary)."""
    from pathlib import Path

    from taps.core.decode import chat_ids
    shipped = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct" / "drafters"
    target = Target.load("smollm2-135m-instruct", device="cpu", dtype="float32")
    cfg = DecodeConfig(max_new_tokens=24, stop_token_ids=target.stop_token_ids())
    prompts = [chat_ids(target.tokenizer, [{"role": "user", "content": text}]) for text in
               ("Tom has 7 apples and buys 5 more. He eats 3. How many apples does he have left?",
                "Give me three tips for staying focused while studying.")]
    plain = [generate(target, None, ids, cfg).tokens for ids in prompts]
    tree = TreeConfig(16, 5, 4)  # the CPU's fast shape: the same round trip as 60/5/10 at a fraction of the suite's time
    names = sorted(p.name for p in shipped.iterdir() if p.is_dir())
    assert len(names) == 13
    for name in names:
        original = load_head(shipped / name, target)
        runs = [generate(target, SingleProposer(original, tree), ids, cfg) for ids in prompts]
        accepted = sum(s.accepted for r in runs for s in r.steps)
        for engine in ("sglang", "vllm"):
            loaded = load_head(export_head(shipped / name, engine, tmp_path / f"{name}-{engine}").out, target)
            for key, value in original.state_dict().items():
                assert torch.equal(loaded.state_dict()[key], value), (name, engine, key)
            runs_x = [generate(target, SingleProposer(loaded, tree), ids, cfg) for ids in prompts]
            assert [r.tokens for r in runs_x] == plain, (name, engine)
            accepted_x = sum(s.accepted for r in runs_x for s in r.steps)
            if engine == "sglang":
                assert [[s.accepted for s in r.steps] for r in runs_x] == [[s.accepted for s in r.steps] for r in runs]
            assert accepted_x > 0 and abs(accepted_x - accepted) <= max(2, NOISE * accepted), (name, engine,
                                                                                                accepted, accepted_x)


@pytest.mark.parametrize("architectures", [["LlamaForCausalLMEagle3"], ["LlamaForCausalLM"]])
def test_specforge_eagle3_checkpoint_loads(tmp_path, eagle3_setting, architectures):
    """An EAGLE-3 head as SpecForge saves it (no taps block, a frozen copy of the embedding) or in
    vLLM's naming (LlamaForCausalLM, told apart by its midlayer tensors) is a TAPS drafter."""
    _, target, head, ids = eagle3_setting
    src = save_head(head, tmp_path / "specforge", DrafterInfo(backbone="eagle3"))
    config = json.loads((src / "config.json").read_text())
    del config["taps"]
    config["architectures"] = architectures
    (src / "config.json").write_text(json.dumps(config))
    tensors = load_file(src / "model.safetensors")
    tensors["embed_tokens.weight"] = target.embed_tokens.weight.detach().clone()
    save_file(tensors, src / "model.safetensors")
    with pytest.warns(UserWarning, match="no taps.tokenizer_fingerprint"):
        loaded = load_head(src, target)
    assert loaded.aux_layers == head.aux_layers and torch.equal(loaded.draft_ids, ids)
    for key, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


@pytest.mark.parametrize("engine, flags", [
    ("sglang", ["--speculative-algorithm EAGLE3 ", "--speculative-draft-model-path"]),
    ("vllm", ['"method": "eagle3"']),
    ("llama.cpp", ["convert_hf_to_gguf.py", "--spec-type draft-eagle3", "--spec-draft-p-min 0.7"]),
])
def test_export_prints_the_engines_command(tmp_path, eagle3_setting, engine, flags, capsys, monkeypatch):
    """`taps export` ends with the command that serves the export in its engine, naming the export."""
    monkeypatch.delenv("TAPS_LLAMA_CPP", raising=False)
    _, _, head, _ = eagle3_setting
    src = save_head(head, tmp_path / "eagle3-head", DrafterInfo(backbone="eagle3", tokenizer_fingerprint=None))
    assert main(["export", str(src), "--engine", engine, "--out", str(tmp_path / "out")]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("serve it with: ")
    assert all(flag in last for flag in flags), last
    assert str(tmp_path / "out") in last


def test_sglang_command_names_the_token_map_of_an_eagle2_head(tmp_path, setting, capsys):
    src = _saved(tmp_path, setting, "eagle2")
    assert main(["export", str(src), "--engine", "sglang", "--out", str(tmp_path / "out")]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "--speculative-algorithm EAGLE " in last
    assert f"--speculative-token-map {tmp_path / 'out' / TOKEN_MAP_NAME}" in last
