"""Prompt lookup as a Proposer: the n-gram continuations it drafts, its calibrated scores, and
losslessness alone and inside routed and merged compositions (greedy identity, sampling)."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import cached_model, hf_greedy, llama_with_head
from taps.core.config import DecodeConfig, SamplingConfig, TreeConfig
from taps.core.decode import generate
from taps.propose.factory import LookupSpec, build_proposer
from taps.propose.lookup import LookupProposer
from taps.core.target import Target
from taps.core.testing import tiny_model
from taps.core.verify import Acceptance

TREE = TreeConfig(total_tokens=16, depth=5, top_k=4)


def started(seq, tree=TREE, **kw):
    proposer = LookupProposer(tree, LookupSpec(**kw))
    proposer.start(torch.zeros(len(seq) - 1, 4), torch.tensor(seq))
    return proposer


def test_longest_match_first_then_most_recent():
    seq = [5, 6, 7, 8, 1, 9, 6, 7, 3, 2, 5, 6, 7]
    # (5, 6, 7) occurs once before the end: its continuation comes first; then (6, 7)'s other one
    assert started(seq).continuations() == [[8, 1, 9, 6, 7], [3, 2, 5, 6, 7]]
    assert started(seq, min_ngram=3).continuations() == [[8, 1, 9, 6, 7]]
    assert started([1, 2, 3, 4]).continuations() == []  # nothing repeats: no draft


def test_a_continuation_reaching_the_end_repeats_its_period():
    # "1 2" occurred 2 tokens back: what follows it is "1 2" itself, and then again what it predicted
    assert started([7, 1, 2, 1, 2]).continuations() == [[1, 2, 1, 2, 1]]
    # an occurrence far enough back keeps its own tokens (depth 5 fits before the end)
    assert started([3, 9, 8, 7, 6, 5, 4, 3]).continuations() == [[9, 8, 7, 6, 5]]
    # a loop of period 3 drafts to the full depth from its first repeat; older occurrences repeat it
    loop = [9, 4, 5, 6, 4, 5, 6, 4]
    assert started(loop, tree=TreeConfig(total_tokens=16, depth=8, top_k=4)).continuations()[0] == \
        [5, 6, 4, 5, 6, 4, 5, 6]


def test_tree_is_a_trie_with_calibrated_scores():
    seq = [4, 1, 2, 3, 9, 4, 1, 2, 8, 4]
    proposer = started(seq)
    tree = proposer.propose()
    assert tree.tokens[0].item() == 4
    # continuations after "4": [1, 2, 8, 4, 1] (most recent, running into the end: it repeats its
    # period "1 2 8 4") and [1, 2, 3, 9, 4]: they share "1 2"
    paths = [[tree.tokens[i].item() for i in row if i >= 0][1:] for row in tree.paths()]
    assert sorted(paths) == [[1, 2, 3, 9, 4], [1, 2, 8, 4, 1]]
    assert tree.size == 1 + 2 + 3 + 3
    depth = tree.depth()
    first_rank = (tree.logp[1:] - depth[1:] * math.log(0.5)).abs() < 1e-6  # rank 0 nodes: d * log q
    assert int(first_rank.sum()) == 5  # 1, 2, 8, 4, 1 from the most recent occurrence
    assert bool((tree.logp[1:] <= tree.logp[tree.parents[1:]] + 1e-6).all())  # scores fall along paths


def test_budget_caps_the_tree():
    seq = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 7, 1]
    small = started(seq, tree=TreeConfig(total_tokens=4, depth=3, top_k=4)).propose()
    assert small.size == 4


def test_a_budget_keeps_the_best_scores_not_the_first_continuation():
    # after "9": the most recent occurrence drafts 7 8 9 7 (its period), the older one 1 2 3 4;
    # four nodes keep 7 (log q), 8 and 1 (2 log q; log q - log 2), then 9 (ties keep the earlier),
    # not the first continuation's four levels
    seq = [9, 1, 2, 3, 4, 5, 9, 7, 8, 9]
    tree = started(seq, tree=TreeConfig(total_tokens=5, depth=4, top_k=4)).propose()
    paths = sorted([tree.tokens[i].item() for i in row if i >= 0][1:] for row in tree.paths())
    assert paths == [[1], [7, 8, 9]]


def test_acceptance_rate_is_learned_from_what_the_target_emitted():
    seq = [4, 1, 2, 3, 9, 4]
    proposer = started(seq)
    tree = proposer.propose()  # the chain 1, 2, 3, 9, 4
    # the target emitted 1, 2 and then 7 (the draft's 3 was rejected), whichever tree was verified
    acceptance = Acceptance(nodes=torch.tensor([0, 1, 2]), tokens=torch.tensor([4, 1, 2]), bonus=7)
    proposer.observe(tree, acceptance, torch.zeros(3, 4))
    assert proposer.accepted == 1 + 2 and proposer.tried == 2 + 3
    assert proposer._seq[-3:] == [1, 2, 7]
    assert tree.size == 6


def test_acceptance_is_learned_per_match_length_and_depth_and_prices_each_node():
    """A copy, once begun, goes on: each (match n, depth band) cell learns its own rate, leaning
    to the pooled q until it has trials of its own, and a node's score sums its path's cells."""
    from taps.propose.lookup import CELL_PRIOR, depth_band

    seq = [4, 1, 2, 3, 9, 5, 6, 4]
    proposer = started(seq, tree=TreeConfig(total_tokens=16, depth=7, top_k=4))
    assert proposer.matches() == [(1, [1, 2, 3, 9, 5, 6, 4])]
    tree = proposer.propose()
    # the target takes 1, 2, 3, 9, 5 and then 7: depths 1-5 accepted, depth 6 rejected
    acceptance = Acceptance(nodes=torch.arange(6), tokens=torch.tensor([4, 1, 2, 3, 9, 5]), bonus=7)
    proposer.observe(tree, acceptance, torch.zeros(6, 4))
    assert proposer.accepted == 1 + 5 and proposer.tried == 2 + 6
    assert proposer.cells[(1, 1)] == [1, 1] and proposer.cells[(1, 4)] == [2, 3]  # depths 4, 5, 6: band 4
    q = proposer.q
    assert proposer.q_at(1, 1) == pytest.approx((1 + CELL_PRIOR * q) / (1 + CELL_PRIOR))
    assert proposer.q_at(1, 5) == pytest.approx((2 + CELL_PRIOR * q) / (3 + CELL_PRIOR))
    assert proposer.q_at(3, 1) == pytest.approx(q)  # a cell without trials reads as the pooled q
    assert [depth_band(d) for d in (1, 2, 3, 4, 7, 8, 40)] == [1, 2, 3, 4, 4, 8, 8]
    # "4 1" again: both earlier "4 1"s match with n = 2, the most recent first (its chain goes on
    # 2 3 9 5 7 4 1), the older one shares 2 3 9 5 and then goes 6 4 1, a rank lower
    proposer._append([4, 1])
    assert [n for n, _ in proposer.matches()] == [2, 2]
    tree = proposer.propose()
    assert tree.tokens[1:8].tolist() == [2, 3, 9, 5, 7, 4, 1] and tree.parents[1:8].tolist() == list(range(7))
    expected, score = [], 0.0
    for j in range(1, 8):
        score += math.log(proposer.q_at(2, j))
        expected.append(score)
    first = tree.logp[1:8].tolist()
    assert first == pytest.approx(expected)  # rank 0's nodes: the sum of their path's cells
    assert tree.logp[8].item() == pytest.approx(expected[4] - math.log(2))  # rank 1's first own node: 6


ARCH_TREE = TreeConfig(total_tokens=24, depth=5, top_k=4)


def loop_prompt():
    return [11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_lookup_is_lossless_and_accepts_repeats(arch):
    model = cached_model(arch)
    target = Target(model)
    prompt = loop_prompt()
    reference = hf_greedy(model, prompt, 40)
    result = generate(target, LookupProposer(ARCH_TREE), prompt, DecodeConfig(max_new_tokens=40))
    assert result.tokens == reference
    # a random tiny model falls into loops, which lookup drafts: some drafts are accepted
    assert result.acceptance_length > 1.0


@pytest.mark.parametrize("spec", [dict(strategy="route", signal="confidence", granularity="step"),
                                  dict(strategy="route", signal="entropy", granularity="turn"),
                                  dict(strategy="merge", merge_mode="disjoint"),
                                  dict(strategy="merge", merge_mode="trie"),
                                  dict(strategy="merge", merge_mode="budget")])
def test_lookup_composed_with_a_head_is_lossless(spec):
    model, target, head = llama_with_head()
    proposer = build_proposer(heads={"head": head, "lookup": LookupSpec()}, tree=ARCH_TREE, **spec)
    prompt = loop_prompt()
    result = generate(target, proposer, prompt, DecodeConfig(max_new_tokens=32))
    assert result.tokens == hf_greedy(model, prompt, 32)


def test_lookup_cannot_be_averaged():
    model, target, head = llama_with_head()
    with pytest.raises(ValueError, match="lookup is prompt lookup"):
        build_proposer("average", heads={"head": head, "lookup": LookupSpec()})


@pytest.mark.parametrize("sized", [False, True])
def test_sampling_with_lookup_keeps_the_target_distribution(sized):
    """The second new token over many seeds, with lookup drafting from a prompt that repeats,
    against the exact marginal of the target (test_decode's shared check); `sized`: each tree
    cut by cost (`--tree auto`, drafter/auto_tree.size_by_cost)."""
    from test_decode import check_second_token_distribution
    from taps.drafter.auto_tree import AutoTree, StepCosts

    model = tiny_model("llama", seed=7, vocab_size=8, hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    prompt = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 6, 1, 2]  # every token after "2" has been seen: drafts exist
    n = 1500
    # the drafter learns across seeds that a random model rarely copies (q falls): at 1/1280 ms per
    # tree token its likeliest nodes still pay and its unlikeliest (deep, low-ranked) are cut
    gentle = StepCosts(verify_ms={1: 10.0, 129: 10.1}, level_ms={1: 1.0})

    def proposer(target):
        return LookupProposer(TreeConfig(8, 3, 4), policy=AutoTree(gentle, top_k=4) if sized else None)

    made = []
    accepted = check_second_token_distribution(model, lambda target: made.append(proposer(target)) or made[0],
                                               prompt, n)
    assert accepted > n // 100  # lookup drafts were accepted (and rejected): both paths exercised
    if sized:  # trees of every size between a plain step and the whole budget were verified
        chosen = {tokens for _, tokens in made[0].policy.chosen}
        assert 1 < len(chosen) and min(chosen) < 8 and max(chosen) > 2

def test_cli_and_study_name_lookup_as_a_member(tmp_path, target_dir, capsys):
    import json

    from taps.cli.main import main
    from taps.propose.factory import HeadPool
    from taps.propose.spec import parse_variant

    args = ["generate", "--target", str(target_dir), "--prompt-ids", ",".join(map(str, loop_prompt())),
            "--max-new-tokens", "24", "--device", "cpu", "--json", "--total-tokens", "16", "--top-k", "4"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(args + ["--drafter", "lookup"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"]
    head = tmp_path / "head"
    assert main(["drafter", "init", "--target", str(target_dir), "--out", str(head)]) == 0
    variant = parse_variant(f"mix=merge-budget:head={head},lookup")
    assert variant.drafters == (("head", str(head)), ("lookup", "lookup"))
    pool = HeadPool(Target.load(target_dir, device="cpu", dtype="float32"))
    assert pool.proposer(variant, TREE) is not None
    with pytest.raises(ValueError, match="prompt lookup"):
        pool.proposer(parse_variant(f"avg=average:head={head},lookup"), TREE)
