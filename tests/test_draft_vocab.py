"""Draft vocabularies (taps.train.draft_vocab): which tokens are counted (those the loss is about),
the choice (most frequent, ties by id, stop tokens first), and `taps drafter reduce-vocab` with its
one-line errors."""

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import hf_greedy
from taps.cli.main import main
from taps.core.config import DecodeConfig, TreeConfig
from taps.data.features import FeatureSet, FeatureShards
from taps.core.decode import generate
from taps.drafter.checkpoint import DrafterInfo, init_head, load_head, read_config, save_head
from taps.propose.single import SingleProposer
from taps.train.draft_vocab import choose_draft_vocab, loss_token_counts, select_draft_vocab
from taps.train.losses import head_pairs, pad_batch
from test_features import make_features


@pytest.fixture(scope="module")
def features(tmp_path_factory, target):
    return make_features(tmp_path_factory, target, "vocab-feat", n=14, records_per_shard=4)


@pytest.fixture(scope="module")
def drafter(tmp_path_factory, target):
    info = DrafterInfo(backbone="eagle2", training_data="unit", tokenizer_fingerprint=target.fingerprint())
    return save_head(init_head(target.model.config, seed=5), tmp_path_factory.mktemp("drafter") / "full", info)


def counted_by_the_loss(shards, indices, max_len=None):
    """Reference count from the loss's own alignment: the token after each counted pair's target
    position (head_pairs weight), record by record."""
    counts = torch.zeros(384, dtype=torch.long)
    for i in indices:
        rec = shards[i]
        n = rec["input_ids"].shape[0] if max_len is None else min(max_len, rec["input_ids"].shape[0])
        ids = rec["input_ids"][:n].long()
        weight = head_pairs(pad_batch([(ids, rec["hidden"][:n], rec["loss_mask"][:n])])).weight[0]  # [T-1] pair t
        for t in weight.nonzero().flatten().tolist():
            if t + 2 < n:  # pair t's distribution is over token t + 2, when the data has it
                counts[ids[t + 2]] += 1
    return counts


def test_counts_are_the_tokens_the_loss_is_about(features):
    shards = FeatureShards(features)
    whole = FeatureSet.from_specs(str(features))
    assert torch.equal(loss_token_counts(whole, 384), counted_by_the_loss(shards, range(len(shards))))
    some = [0, 3, 4, 9, 13]  # across shards of 4 records
    cut = loss_token_counts(whole, 384, some, max_len=58)  # the trainer's --max-len cut: fewer tokens, not none
    assert torch.equal(cut, counted_by_the_loss(shards, some, max_len=58))
    assert 0 < int(cut.sum()) < int(loss_token_counts(whole, 384, some).sum())
    limited = FeatureSet.from_specs(f"{features}:6")  # DIR:LIMIT counts the first 6 records only
    assert torch.equal(loss_token_counts(limited, 384), counted_by_the_loss(shards, range(6)))
    assert int(loss_token_counts(whole, 384).sum()) < sum(int(shards[i]["loss_mask"].sum()) for i in range(14))


def test_selection_ties_and_stop_tokens():
    counts = torch.tensor([5, 0, 7, 5, 1, 7, 0, 2])
    assert select_draft_vocab(counts, 3).tolist() == [0, 2, 5]  # 7, 7, then the lower id of the two 5s
    assert select_draft_vocab(counts, 4).tolist() == [0, 2, 3, 5]
    assert select_draft_vocab(counts, 3, always=[6, 99]).tolist() == [2, 5, 6]  # 6 first; 99 is no token
    assert select_draft_vocab(counts, 8).tolist() == list(range(8))
    for bad in (0, 9):
        with pytest.raises(ValueError, match=f"size {bad} must be between 1 and the target's vocabulary size 8"):
            select_draft_vocab(counts, bad)


def test_choice_reports_coverage(features):
    whole = FeatureSet.from_specs(str(features))
    counts = loss_token_counts(whole, 384)
    vocab = choose_draft_vocab(whole, 384, 10)
    assert vocab.counted == int(counts.sum())
    assert vocab.coverage == pytest.approx(float(counts.sort(descending=True).values[:10].sum() / counts.sum()))
    assert choose_draft_vocab(whole, 384, 384).coverage == 1.0


# ---- taps drafter reduce-vocab ------------------------------------------------------------------------
def test_reduce_vocab_command(tmp_path, target, features, drafter, capsys):
    out = tmp_path / "reduced"
    assert main(["drafter", "reduce-vocab", "--drafter", str(drafter), "--features", f"{features},{features}:3",
                 "--size", "24", "--out", str(out)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"wrote {out}: a draft vocabulary of 24 tokens covers ") and "assistant tokens" in line
    head = load_head(out, target)  # strict
    _, info = read_config(out)
    both = FeatureSet.from_specs([str(features), f"{features}:3"])
    counts = loss_token_counts(both, 384)
    assert torch.equal(head.draft_ids, select_draft_vocab(counts, 24))
    assert info.extra["draft_vocab_coverage"] == pytest.approx(float(counts[head.draft_ids].sum() / counts.sum()),
                                                               abs=1e-6)
    assert info.training_data == "unit" and info.tokenizer_fingerprint == target.fingerprint()
    source, written = load_file(drafter / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(written) == set(source) | {"d2t", "t2d"}
    assert all(torch.equal(written[k], v) for k, v in source.items())  # weights unchanged
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 24
    prompt = [5, 9, 13, 2]
    assert generate(target, SingleProposer(head, TreeConfig(20, 3, 4)), prompt,
                    DecodeConfig(max_new_tokens=10)).tokens == hf_greedy(target.model, prompt, 10)
    # a reduced head reduced again gets the new vocabulary
    assert main(["drafter", "reduce-vocab", "--drafter", str(out), "--features", str(features), "--size", "5",
                 "--out", str(tmp_path / "again")]) == 0
    assert load_head(tmp_path / "again", target).draft_ids.numel() == 5


@pytest.mark.parametrize("case, message", [
    ("missing-features", "manifest.json: missing; run `taps features` first"),
    ("zero", "draft vocabulary size 0 must be between 1 and the target's vocabulary size 384"),
    ("negative", "draft vocabulary size -3 must be between 1"),
    ("too-big", "draft vocabulary size 385 must be between 1 and the target's vocabulary size 384"),
    ("missing-drafter", "config.json: missing"),
])
def test_reduce_vocab_bad_input_is_one_line_and_exit_2(tmp_path, features, drafter, capsys, case, message):
    feats, size, head = str(features), "8", str(drafter)
    if case == "missing-features":
        feats = f"{features},{tmp_path / 'nowhere'}"
    elif case == "missing-drafter":
        head = str(tmp_path / "no-drafter")
    else:
        size = {"zero": "0", "negative": "-3", "too-big": "385"}[case]
    code = main(["drafter", "reduce-vocab", "--drafter", head, "--features", feats, "--size", size,
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("taps drafter: error: ") and message in err
    assert not (tmp_path / "out" / "model.safetensors").exists()
