"""Feature shards: round trip, resume after an interruption, refusal to mix targets or data."""

import json

import pytest
import torch

from taps.data import features as features_mod
from taps.data.chat import encode_conversation
from taps.data.features import FeatureSet, FeatureSettings, FeatureShards, FeaturesError, extract_features
from taps.core.target import Target
from taps.core.testing import SAMPLE_CORPUS, write_tiny_target


def make_features(tmp_path_factory, target, name: str, n: int, records_per_shard: int):
    """Features of n sample conversations (max_len 64, fp32) in a fresh directory: a fixture body."""
    root = tmp_path_factory.mktemp(name)
    data = write_records(root / "data.jsonl", n=n)
    extract_features(target, data, root / "f", FeatureSettings(max_len=64, dtype="fp32",
                                                               records_per_shard=records_per_shard), progress=None)
    return root / "f"


def write_records(path, n=20):
    with path.open("w") as f:
        for i in range(n):
            convo = [{"role": "user", "content": SAMPLE_CORPUS[i % len(SAMPLE_CORPUS)]},
                     {"role": "assistant", "content": " ".join(SAMPLE_CORPUS[(i + k) % len(SAMPLE_CORPUS)] for k in range(1, 2 + i % 3))}]
            f.write(json.dumps({"id": f"r{i}", "source": "math" if i % 2 else "chat", "conversations": convo}) + "\n")
    return path


@pytest.fixture
def data(tmp_path):
    return write_records(tmp_path / "data.jsonl")


def test_round_trip(tmp_path, target, data):
    settings = FeatureSettings(max_len=48, dtype="fp32", records_per_shard=6, tokens_per_batch=200)
    manifest = extract_features(target, data, tmp_path / "f", settings, progress=None)
    assert manifest["complete"] and manifest["records_done"] == 20 and len(manifest["shards"]) == 4
    assert manifest["sources"] == {"chat": 10, "math": 10}
    assert manifest["tokenizer_fingerprint"] == target.fingerprint()
    shards = FeatureShards(tmp_path / "f", fingerprint=target.fingerprint())
    assert len(shards) == 20
    records = [json.loads(line) for line in data.read_text().splitlines()]
    truncated = 0
    for i in (0, 7, 19):
        ids, mask = encode_conversation(target.tokenizer, records[i]["conversations"])
        truncated += len(ids) > 48
        rec = shards[i]
        assert rec["input_ids"].tolist() == ids[:48] and rec["loss_mask"].tolist() == mask[:48]
        # hidden equals a fresh unbatched forward (batching with padding changes nothing)
        expected = target.encode(torch.tensor(ids[:48]))[0]
        assert torch.allclose(rec["hidden"], expected, atol=1e-5)
    assert manifest["tokens"] == sum(int(shards[i]["input_ids"].shape[0]) for i in range(20))
    assert manifest["assistant_tokens"] == sum(int(shards[i]["loss_mask"].sum()) for i in range(20))


def test_resume_after_interruption(tmp_path, target, data, monkeypatch):
    settings = FeatureSettings(max_len=64, dtype="bf16", records_per_shard=5)
    extract_features(target, data, tmp_path / "whole", settings, progress=None)
    calls = {"n": 0}
    real = features_mod._features_in_batches

    def dying(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # killed while computing the third shard
        return real(*args, **kwargs)

    monkeypatch.setattr(features_mod, "_features_in_batches", dying)
    with pytest.raises(KeyboardInterrupt):
        extract_features(target, data, tmp_path / "cut", settings, progress=None)
    partial = json.loads((tmp_path / "cut" / "manifest.json").read_text())
    assert partial["records_done"] == 10 and not partial["complete"]
    monkeypatch.setattr(features_mod, "_features_in_batches", real)
    manifest = extract_features(target, data, tmp_path / "cut", settings, progress=None)
    assert manifest["complete"] and manifest["records_done"] == 20 and len(manifest["shards"]) == 4
    a, b = FeatureShards(tmp_path / "whole"), FeatureShards(tmp_path / "cut")
    for i in range(20):
        assert torch.equal(a[i]["hidden"], b[i]["hidden"]) and torch.equal(a[i]["input_ids"], b[i]["input_ids"])


def test_refuses_to_mix(tmp_path, target, data):
    extract_features(target, data, tmp_path / "f", FeatureSettings(max_len=32), progress=None)
    other_dir = write_tiny_target(tmp_path / "other", "qwen2", seed=1)
    other = Target.load(other_dir, device="cpu", dtype="float32")
    other.tokenizer.add_tokens(["<|extra|>"])  # another tokenizer: another fingerprint
    with pytest.raises(FeaturesError, match="tokenizer_fingerprint"):
        extract_features(other, data, tmp_path / "f", FeatureSettings(max_len=32), progress=None)
    with pytest.raises(FeaturesError, match="max_len"):
        extract_features(target, data, tmp_path / "f", FeatureSettings(max_len=16), progress=None)
    changed = write_records(tmp_path / "changed.jsonl", n=21)
    with pytest.raises(FeaturesError, match="data_digest"):
        extract_features(target, changed, tmp_path / "f", FeatureSettings(max_len=32), progress=None)
    with pytest.raises(FeaturesError, match="made for tokenizer"):
        FeatureShards(tmp_path / "f", fingerprint="sha256:0")


def test_bad_records_named(tmp_path, target):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "conversations": []}\n{not json}\n')
    with pytest.raises(FeaturesError, match=r"bad.jsonl:2: invalid JSON"):
        extract_features(target, bad, tmp_path / "f", progress=None)
    bad.write_text('{"id": "a", "messages": []}\n')
    with pytest.raises(FeaturesError, match=r"bad.jsonl:1: expected an object with a 'conversations' list"):
        extract_features(target, bad, tmp_path / "f", progress=None)


def test_feature_set_concatenates_prefixes(tmp_path, target):
    a = extract_features(target, write_records(tmp_path / "a.jsonl", n=8), tmp_path / "fa", FeatureSettings(max_len=32),
                         progress=None)
    b = extract_features(target, write_records(tmp_path / "b.jsonl", n=6), tmp_path / "fb", FeatureSettings(max_len=32),
                         progress=None)
    assert a["complete"] and b["complete"]
    both = FeatureSet.from_specs([f"{tmp_path / 'fa'}:3", str(tmp_path / "fb")], fingerprint=target.fingerprint())
    assert len(both) == 9 and both.hidden_size == target.hidden_size
    fa, fb = FeatureShards(tmp_path / "fa"), FeatureShards(tmp_path / "fb")
    assert torch.equal(both[2]["hidden"], fa[2]["hidden"]) and torch.equal(both[3]["hidden"], fb[0]["hidden"])
    with pytest.raises(IndexError):
        both[9]
    with pytest.raises(FeaturesError, match="first 9 records, it has 8"):
        FeatureSet.from_specs(f"{tmp_path / 'fa'}:9")


def test_records_keep_unicode_line_separators(tmp_path):
    """A data file written by taps data mix holds U+2028 / U+0085 raw inside strings (json.dumps with
    ensure_ascii=False); the reader splits lines at newlines only, like every reader of taps.core.jsonl."""
    from taps.data.features import read_conversations
    from taps.core.jsonl import write_jsonl

    record = {"id": "u", "source": "s", "conversations": [{"role": "user", "content": "a\u2028b\u0085c"},
                                                          {"role": "assistant", "content": "d"}]}
    path = write_jsonl([record], tmp_path / "u.jsonl")
    assert "\u2028" in path.read_text(encoding="utf-8")
    assert read_conversations(path) == [record]
