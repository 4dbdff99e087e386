"""Weight averaging of heads (taps.drafter.average) and the `taps average` command."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from taps.drafter.average import (AverageError, average_checkpoints, average_heads, check_weights, lambda_sweep,
                                  sweep_checkpoints)
from taps.drafter.checkpoint import DrafterInfo, init_head, load_head, read_config, save_head
from taps.cli import propose as commands
from taps.core.testing import tiny_config


def heads(target, *seeds):
    return [init_head(target.model.config, seed=s) for s in seeds]


def expected(states, weights, key):
    acc = sum(w * s[key].double() for w, s in zip(weights, states))
    return acc.float()


def test_weighted_sum_of_every_parameter(target):
    a, b, c = heads(target, 1, 2, 3)
    avg = average_heads([a, b, c], [0.2, 0.3, 0.5])
    states = [h.state_dict() for h in (a, b, c)]
    assert set(avg.state_dict()) == set(states[0])
    for key, value in avg.state_dict().items():
        assert torch.equal(value, expected(states, [0.2, 0.3, 0.5], key)), key
        assert not torch.equal(value, states[0][key]) or key.endswith("layernorm.weight")
    # the inputs are untouched, and a one-hot weight gives a head back exactly
    assert torch.equal(a.fc.weight, init_head(target.model.config, seed=1).fc.weight)
    back = average_heads([a, b], [1.0, 0.0])
    assert all(torch.equal(v, a.state_dict()[k]) for k, v in back.state_dict().items())
    assert avg.config.to_dict() == a.config.to_dict() and avg.bias == a.bias


def test_averaged_head_is_bound_like_the_first(target):
    a, b = (h.bind(target.embed_tokens, target.lm_head) for h in heads(target, 1, 2))
    avg = average_heads([a, b])
    embed, lm_head = avg.shared
    assert embed is target.embed_tokens and lm_head is target.lm_head
    assert not any("embed" in n or "lm_head" in n for n, _ in avg.named_parameters())
    default = average_heads([a, b], None)
    assert torch.equal(default.fc.weight, expected([a.state_dict(), b.state_dict()], [0.5, 0.5], "fc.weight"))


@pytest.mark.parametrize("weights, message", [
    ([0.5, 0.6], "must sum to 1"),
    ([0.5], "1 weight.*for 2 head"),
    ([1.5, -0.5], "non-negative"),
    ([float("nan"), 1.0], "finite"),
])
def test_bad_weights_are_refused(target, weights, message):
    with pytest.raises(AverageError, match=message):
        average_heads(heads(target, 1, 2), weights)


def test_heads_must_share_shapes_and_config(target):
    a = init_head(target.model.config, seed=1)
    wider = init_head(tiny_config("llama", intermediate=96), seed=2)
    with pytest.raises(AverageError, match="intermediate_size: head 0 has 128, head 1 has 96"):
        average_heads([a, wider])
    biased = init_head(target.model.config, seed=2, bias=True)
    with pytest.raises(AverageError, match="fc bias"):
        average_heads([a, biased])
    other_rope = init_head(tiny_config("llama", rope_theta=500000.0), seed=2)
    with pytest.raises(AverageError, match="rope_theta"):
        average_heads([a, other_rope])


def test_lambda_sweep(target):
    a, b = heads(target, 1, 2)
    sweep = list(lambda_sweep(a, b))
    assert [lam for lam, _ in sweep] == pytest.approx([0.1 * i for i in range(1, 10)])
    for lam, head in sweep:
        assert torch.equal(head.fc.weight, expected([a.state_dict(), b.state_dict()], [lam, 1 - lam], "fc.weight"))
    with pytest.raises(AverageError, match="lambda must be in"):
        list(lambda_sweep(a, b, [1.2]))


# ---- checkpoints ----------------------------------------------------------------------------------
def save(target, path, seed, data, fingerprint="target"):
    info = DrafterInfo(backbone="hass", training_data=data, target_name="tiny",
                       tokenizer_fingerprint=target.fingerprint() if fingerprint == "target" else fingerprint)
    return save_head(init_head(target.model.config, seed=seed), path, info)


def test_average_checkpoints_round_trip(tmp_path, target):
    pa, pb = save(target, tmp_path / "math", 1, "math"), save(target, tmp_path / "chat", 2, "chat")
    out = average_checkpoints([pa, pb], tmp_path / "avg", [0.25, 0.75], names=["math", "chat"])
    loaded = load_head(out, target)  # strict load: keys, shapes, fingerprint
    _, info = read_config(out)
    a = load_head(pa, target)
    b = load_head(pb, target)
    in_memory = average_heads([a, b], [0.25, 0.75])
    for key, value in in_memory.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert info.backbone == "hass" and info.tokenizer_fingerprint == target.fingerprint()
    assert info.training_data == "0.25*math + 0.75*chat"
    assert [(s["name"], s["weight"]) for s in info.extra["averaged_from"]] == [("math", 0.25), ("chat", 0.75)]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle"] and config["num_hidden_layers"] == 1


def test_checkpoints_for_another_tokenizer_are_refused(tmp_path, target):
    pa = save(target, tmp_path / "a", 1, "math")
    pb = save(target, tmp_path / "b", 2, "chat", fingerprint="sha256:0000")
    with pytest.raises(AverageError, match="different target tokenizers"):
        average_checkpoints([pa, pb], tmp_path / "avg")
    assert not (tmp_path / "avg" / "model.safetensors").exists()


def test_checkpoint_shape_mismatch_names_the_key(tmp_path, target):
    pa, pb = save(target, tmp_path / "a", 1, "math"), save(target, tmp_path / "b", 2, "chat")
    tensors = load_file(pb / "model.safetensors")
    tensors["layers.0.mlp.up_proj.weight"] = torch.zeros(96, 64)
    save_file(tensors, pb / "model.safetensors")
    with pytest.raises(AverageError, match=r"layers.0.mlp.up_proj.weight: .* has shape \(128, 64\), .* has \(96, 64\)"):
        average_checkpoints([pa, pb], tmp_path / "avg")
    tensors.pop("layers.0.mlp.up_proj.weight")
    save_file(tensors, pb / "model.safetensors")
    with pytest.raises(AverageError, match="missing layers.0.mlp.up_proj.weight"):
        average_checkpoints([pa, pb], tmp_path / "avg")


def test_sweep_checkpoints(tmp_path, target):
    pa, pb = save(target, tmp_path / "a", 1, "math"), save(target, tmp_path / "b", 2, "chat")
    outs = sweep_checkpoints(pa, pb, tmp_path / "sweep", [0.1, 0.5])
    assert [o.name for o in outs] == ["lambda-0.1", "lambda-0.5"]
    head = load_head(outs[0], target)
    a, b = load_file(pa / "model.safetensors"), load_file(pb / "model.safetensors")
    assert torch.equal(head.fc.weight, expected([a, b], [0.1, 0.9], "fc.weight"))


# ---- the command ---------------------------------------------------------------------------------
def run_cli(argv):
    parser = argparse.ArgumentParser(prog="taps")
    commands.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_average_command(tmp_path, target, capsys):
    pa, pb = save(target, tmp_path / "a", 1, "math"), save(target, tmp_path / "b", 2, "chat")
    assert run_cli(["average", "--drafter", f"math={pa}", "--drafter", f"chat={pb}", "--weight", "0.4",
                    "--weight", "0.6", "--out", str(tmp_path / "avg")]) == 0
    assert "0.4*math + 0.6*chat" in capsys.readouterr().out
    load_head(tmp_path / "avg", target)
    _, info = read_config(tmp_path / "avg")
    assert [s["name"] for s in info.extra["averaged_from"]] == ["math", "chat"]
    assert run_cli(["average", "--drafter", str(pa), "--drafter", str(pb), "--sweep", "--lambdas", "0.3,0.7",
                    "--out", str(tmp_path / "sweep")]) == 0
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir()) == ["lambda-0.3", "lambda-0.7"]
    with pytest.raises(AverageError, match="must sum to 1"):
        run_cli(["average", "--drafter", str(pa), "--drafter", str(pb), "--weight", "0.4", "--weight", "0.4",
                 "--out", str(tmp_path / "bad")])
    with pytest.raises(ValueError, match="at least two"):
        run_cli(["average", "--drafter", str(pa), "--out", str(tmp_path / "bad")])


def test_parse_named_drafter(tmp_path):
    assert commands.parse_named_drafter("math=/x/y") == ("math", "/x/y")
    assert commands.parse_named_drafter("/x/heads/chat/") == ("chat", "/x/heads/chat/")
    odd = tmp_path / "a=b"
    odd.mkdir()
    assert commands.parse_named_drafter(str(odd)) == ("a=b", str(odd))


def test_generate_strategy_options_feed_the_factory():
    from taps.propose.factory import build_proposer
    from taps.propose.routed import RoutedProposer

    parser = argparse.ArgumentParser()
    parser.add_argument("--drafter", action="append", type=commands.parse_named_drafter)
    commands.add_strategy_arguments(parser)
    args = parser.parse_args(["--drafter", "a=/x", "--drafter", "b=/y", "--strategy", "route", "--signal", "entropy",
                              "--granularity", "turn"])
    options = commands.strategy_options(args)
    assert options == {"strategy": "route", "signal": "entropy", "granularity": "turn", "merge_mode": "disjoint",
                       "weights": None}
    cfg = tiny_config("llama")
    heads = {name: init_head(cfg, seed=i) for i, (name, _) in enumerate(args.drafter)}
    proposer = build_proposer(heads=heads, **options)
    assert isinstance(proposer, RoutedProposer) and proposer.per_turn and proposer.names == ["a", "b"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--strategy", "vote"])


# ---- draft vocabularies: not averaged, united ------------------------------------------------------
def test_heads_with_different_draft_vocabularies_average(target):
    a, b, c = (h.bind(target.embed_tokens, target.lm_head) for h in heads(target, 1, 2, 3))
    a.set_draft_vocab(torch.tensor([1, 5, 9]))
    b.set_draft_vocab(torch.tensor([2, 5, 300]))
    avg = average_heads([a, b], [0.3, 0.7])
    assert avg.draft_ids.tolist() == [1, 2, 5, 9, 300]  # the union
    for key, value in avg.state_dict().items():  # the weights average as for full-vocabulary heads
        assert torch.equal(value, expected([a.state_dict(), b.state_dict()], [0.3, 0.7], key)), key
    assert avg.logits(torch.randn(2, target.hidden_size)).shape == (2, 5)
    assert average_heads([a, c]).draft_ids is None  # a full-vocabulary member: the full vocabulary
    assert average_heads([c, b]).draft_ids is None


def test_average_checkpoints_with_draft_vocabularies(tmp_path, target):
    info = DrafterInfo(backbone="hass", tokenizer_fingerprint=target.fingerprint(),
                       extra={"draft_vocab_coverage": 0.9})
    pa = save_head(init_head(target.model.config, seed=1).set_draft_vocab(torch.tensor([0, 7, 100])),
                   tmp_path / "a", info)
    pb = save_head(init_head(target.model.config, seed=2).set_draft_vocab(torch.tensor([7, 8, 383])),
                   tmp_path / "b", info)
    pc = save(target, tmp_path / "c", 3, "full")
    out = average_checkpoints([pa, pb], tmp_path / "ab", [0.5, 0.5])
    loaded = load_head(out, target)  # strict: d2t / t2d consistent
    _, merged_info = read_config(out)
    assert loaded.draft_ids.tolist() == [0, 7, 8, 100, 383]
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 5
    assert "draft_vocab_coverage" not in merged_info.extra  # the members' coverages do not carry over
    a, b = load_head(pa, target), load_head(pb, target)
    for key, value in average_heads([a, b]).state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    full = average_checkpoints([pa, pc], tmp_path / "ac")
    assert load_head(full, target).draft_ids is None
    assert "draft_vocab_size" not in json.loads((full / "config.json").read_text())
    assert set(load_file(full / "model.safetensors")).isdisjoint({"d2t", "t2d"})
