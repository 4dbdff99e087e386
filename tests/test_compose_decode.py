"""Composed proposers end to end: every strategy and mode is greedy-lossless with 2 and 3 heads on
two architectures; routing logs every decision and picks a far more confident head; identical
heads reduce every composition to single-head decoding; every head's cache stays in sync."""

from __future__ import annotations

import functools

import pytest
import torch

from conftest import cached_model, hf_greedy, prompts
from taps.core.config import DecodeConfig, TreeConfig
from taps.core.decode import generate
from taps.drafter.checkpoint import init_head
from taps.drafter.fit import fit_linear_head, greedy_sequences
from taps.core.proposer import Proposer, StepInfo
from taps.propose.factory import build_proposer
from taps.propose.merged import MergedProposer
from taps.propose.routed import CONFIDENCE, RoutedProposer, RoutingSignal
from taps.propose.single import SingleProposer
from taps.core.target import Target
from taps.core.tree import DraftTree, merge_budget, merge_disjoint, merge_trie

TREE = TreeConfig(60, 5, 10)
NEW = 24
SPECS = {
    "average": dict(strategy="average"),
    "route-step-confidence": dict(strategy="route", signal="confidence", granularity="step"),
    "route-step-entropy": dict(strategy="route", signal="entropy", granularity="step"),
    "route-turn-confidence": dict(strategy="route", signal="confidence", granularity="turn"),
    "route-turn-entropy": dict(strategy="route", signal="entropy", granularity="turn"),
    "route-step-bandit": dict(strategy="route", signal="bandit", granularity="step"),
    "route-turn-bandit": dict(strategy="route", signal="bandit", granularity="turn"),
    "merge-disjoint": dict(strategy="merge", merge_mode="disjoint"),
    "merge-trie": dict(strategy="merge", merge_mode="trie"),
    "merge-budget": dict(strategy="merge", merge_mode="budget"),
}


@functools.lru_cache(maxsize=None)
def setup(arch: str):
    """A target and heads for it: two 'specialists' fitted on different greedy continuations (see
    taps.drafter.fit), a random head and a random head made far more confident."""
    model = cached_model(arch)
    target = Target(model)

    def data(seed):
        g = torch.Generator().manual_seed(seed)
        return greedy_sequences(target, torch.randint(0, model.config.vocab_size, (12, 6), generator=g).tolist(), 32)

    def random_head(seed, scale=1.0):
        head = init_head(model.config, seed=seed)
        with torch.no_grad():
            head.fc.weight.mul_(scale)  # larger residual stream -> sharper head distributions
        return head.bind(target.embed_tokens, target.lm_head)

    heads = {"fit-a": fit_linear_head(target, data(1), seed=3), "fit-b": fit_linear_head(target, data(2), seed=4),
             "random-1": random_head(1), "random-2": random_head(2), "sharp": random_head(5, scale=10.0)}
    return model, target, heads


def head_set(heads, n):
    names = ["fit-a", "random-1"] if n == 2 else ["fit-a", "fit-b", "random-2"]
    return {name: heads[name] for name in names}


def step_tuple(result):
    return [(s.accepted, s.emitted, s.tree_size, s.credited_drafter) for s in result.steps]


# ---- greedy losslessness, every strategy and mode ---------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("spec", sorted(SPECS))
def test_greedy_lossless(arch, n, spec):
    model, target, heads = setup(arch)
    chosen = head_set(heads, n)
    prompt = prompts(8, seed=3)[n]
    proposer = build_proposer(tree=TREE, heads=chosen, **SPECS[spec])
    result = generate(target, proposer, prompt, DecodeConfig(max_new_tokens=NEW))
    assert result.tokens == hf_greedy(model, prompt, NEW)
    assert all(s.tree_size <= TREE.total_tokens * n for s in result.steps)
    if n == 3:  # with both fitted specialists the composition gets drafts accepted
        assert result.acceptance_length > 1.0
    if isinstance(proposer, RoutedProposer):
        assert len(proposer.chosen) == len(result.steps)
        per_turn = SPECS[spec]["granularity"] == "turn"
        assert len(proposer.decisions) == (1 if per_turn else len(result.steps))
        for step, stats in enumerate(result.steps):
            assert stats.tree_size <= TREE.total_tokens
            if stats.accepted:  # StepStats.credited_drafter names the routed drafter
                assert stats.credited_drafter == proposer.chosen[step]
        for d in proposer.decisions:
            assert len(d.scores) == n and d.signal == SPECS[spec]["signal"]
            assert d.chosen == CONFIDENCE.choose(d.scores) if d.signal in ("confidence", "bandit") else \
                d.chosen == min(range(n), key=lambda i: d.scores[i])  # the bandit: its highest index wins
            if d.signal == "bandit":
                assert len(d.prior) == n and d.context == CONFIDENCE.choose(d.prior)
    if isinstance(proposer, MergedProposer):
        assert [r.step for r in proposer.records] == list(range(len(result.steps)))
        for record, stats in zip(proposer.records, result.steps):
            distinct = sum(size - 1 for size in record.input_sizes) + 1
            mode = SPECS[spec]["merge_mode"]
            if mode == "disjoint":
                assert record.merged_size == distinct
            elif mode == "trie":
                assert record.merged_size <= distinct
            else:
                assert record.merged_size <= TREE.total_tokens
            assert stats.tree_size <= record.merged_size
            if record.accepted_drafters is not None and stats.accepted:
                assert record.accepted_drafters >> stats.credited_drafter & 1  # the credited drafter did propose it


# ---- partial acceptance from several drafters: noisy oracles ----------------------------------------
class NoisyOracle:
    """The target's true continuation among decoys, corrupted from a random depth on, with a random
    confidence scale each step (so routing switches between oracles). Two oracles with different
    seeds propose the same tokens along the true path: merged trees contain duplicates."""

    def __init__(self, reference: list[int], vocab: int, seed: int, depth: int = 5):
        self.reference, self.vocab, self.depth, self.seq = reference, vocab, depth, []
        self.g = torch.Generator().manual_seed(seed)

    def start(self, features, tokens):
        self.seq = tokens.tolist()

    def observe(self, tree, acceptance, features):
        self.seq += acceptance.new_tokens

    def step_info(self):
        return StepInfo()

    def propose(self) -> DraftTree:
        true = self.reference[len(self.seq):len(self.seq) + self.depth]
        cut = int(torch.randint(0, len(true) + 1, (1,), generator=self.g))
        parents, tokens, parent = [-1], [self.seq[-1]], 0
        for d, tok in enumerate(true):
            decoy = (tok + 1 + int(torch.randint(0, self.vocab - 1, (1,), generator=self.g))) % self.vocab
            parents += [parent, parent]
            tokens += [decoy, tok if d < cut else (tok + 1) % self.vocab]
            parent = len(tokens) - 1
        n = len(tokens)
        scale = 0.2 + float(torch.rand((), generator=self.g))
        return DraftTree.drafted(tokens=torch.tensor(tokens), parents=torch.tensor(parents),
                                 logp=-scale * torch.arange(n, dtype=torch.float), entropy=scale * torch.ones(n),
                                 drafter=0)


COMPOSERS = {
    "route": lambda ps: RoutedProposer(ps, CONFIDENCE),
    "merge-disjoint": lambda ps: MergedProposer(ps, merge_disjoint),
    "merge-trie": lambda ps: MergedProposer(ps, merge_trie),
    "merge-budget": lambda ps: MergedProposer(ps, lambda ts: merge_budget(ts, 8)),
}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("composer", sorted(COMPOSERS))
def test_partial_acceptance_from_several_drafters_is_lossless(arch, composer):
    model, target, heads = setup(arch)
    prompt = prompts(3, seed=21)[1]
    reference = prompt + hf_greedy(model, prompt, 40)
    vocab = model.config.vocab_size
    proposer = COMPOSERS[composer]([SingleProposer(heads["random-1"], TREE),
                                    NoisyOracle(reference, vocab, seed=1), NoisyOracle(reference, vocab, seed=2)])
    result = generate(target, proposer, prompt, DecodeConfig(max_new_tokens=40))
    assert result.tokens == reference[len(prompt):]
    assert len({s.accepted for s in result.steps}) >= 3  # partial acceptance of varied lengths
    if composer == "route":
        assert {1, 2} <= set(proposer.chosen)  # it did switch between drafters
        assert all(s.credited_drafter == c for s, c in zip(result.steps, proposer.chosen) if s.accepted)
    else:
        credited = [s.credited_drafter for s in result.steps if s.accepted]
        assert set(credited) <= {0, 1, 2} and len(set(credited)) >= 2 - (composer == "merge-budget")
        if composer == "merge-budget":
            assert all(s.tree_size <= 8 for s in result.steps)


# ---- a reduced-vocabulary head composed with a full one -----------------------------------------------
def reduced_copy(model, head, ids):
    """A copy of `head` (same weights, same target) drafting over the target ids `ids` only."""
    copy = init_head(model.config)
    copy.load_state_dict(head.state_dict())
    return copy.bind(*head.shared).eval().set_draft_vocab(ids)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("spec", ["route-step-confidence", "route-turn-entropy", "merge-disjoint", "merge-trie",
                                  "merge-budget", "average"])
def test_reduced_and_full_heads_compose_losslessly(arch, spec):
    """fit-b over the 48 tokens most frequent in its own fitting data, with the full-vocabulary
    fit-a: every composition stays greedy-lossless, the reduced head's drafts get accepted; the weight average
    of a full and a reduced head drafts over the full vocabulary."""
    model, target, heads = setup(arch)
    g = torch.Generator().manual_seed(2)  # fit-b's fitting data, as in setup()
    seqs = greedy_sequences(target, torch.randint(0, model.config.vocab_size, (12, 6), generator=g).tolist(), 32)
    counts = torch.bincount(seqs[:, 6:].flatten(), minlength=model.config.vocab_size)  # [V]
    ids = torch.sort(counts, descending=True, stable=True).indices[:48].sort().values  # [48]
    chosen = {"fit-a": heads["fit-a"], "fit-b-48": reduced_copy(model, heads["fit-b"], ids)}
    proposer = build_proposer(tree=TREE, heads=chosen, **SPECS[spec])
    if spec == "average":
        assert proposer.head.draft_ids is None
    cfg = DecodeConfig(max_new_tokens=NEW)
    accepted = [0, 0]  # accepted drafts credited to fit-a, to the reduced fit-b (the average is drafter 0)
    for prompt in prompts(8, seed=3)[2:5]:
        result = generate(target, proposer, prompt, cfg)
        assert result.tokens == hf_greedy(model, prompt, NEW)
        at = 1  # tokens[0] comes from the prefill; each step emits its accepted drafts, then a bonus
        for stats in result.steps:
            if stats.accepted:
                accepted[stats.credited_drafter] += stats.accepted
            if stats.credited_drafter == 1:  # a path ending at a node of the reduced head's tree: its target ids
                assert set(result.tokens[at:at + stats.accepted]) <= set(ids.tolist())
            at += stats.emitted
    assert accepted[0] > 0 if spec == "average" else accepted[1] > 0


# ---- identical heads: every composition is single-head decoding --------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_identical_heads_reduce_to_single_head(arch):
    model, target, heads = setup(arch)
    twin = {"a": heads["fit-a"], "a-again": init_head(model.config)}
    twin["a-again"].load_state_dict(heads["fit-a"].state_dict())
    twin["a-again"].bind(target.embed_tokens, target.lm_head).eval()
    prompt = prompts(4, seed=9)[2]
    cfg = DecodeConfig(max_new_tokens=NEW)
    single = generate(target, SingleProposer(heads["fit-a"], TREE), prompt, cfg)
    assert single.acceptance_length > 1.0  # the comparison covers accepted drafts
    for spec in ("route-step-confidence", "route-step-entropy", "route-turn-confidence", "merge-trie",
                 "merge-budget"):
        proposer = build_proposer(tree=TREE, heads=twin, **SPECS[spec])
        result = generate(target, proposer, prompt, cfg)
        assert result.tokens == single.tokens, spec
        assert step_tuple(result) == step_tuple(single), spec  # step for step: same trees, same acceptance
        if isinstance(proposer, RoutedProposer):
            assert all(d.chosen == 0 and d.scores[0] == d.scores[1] for d in proposer.decisions)
    # at the level of one tree: the trie of identical trees is the single tree, node for node
    merged = build_proposer("merge", twin, TREE, merge_mode="trie")
    one = SingleProposer(heads["fit-a"], TREE)
    features = target.encode(torch.tensor([prompt]))[0]
    for p in (merged, one):
        p.start(features[:-1], torch.tensor(prompt))
    a, b = merged.propose(), one.propose()
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    assert torch.equal(a.logp, b.logp) and [a.credited(i) for i in range(a.size)] == [b.credited(i) for i in range(b.size)]
    assert a.drafter_sets()[1:] == [[0, 1]] * (a.size - 1)


# ---- routing records ------------------------------------------------------------------------------
@pytest.mark.parametrize("signal", ["confidence", "entropy"])
@pytest.mark.parametrize("sharp_first", [False, True])
def test_far_more_confident_head_is_routed(signal, sharp_first):
    model, target, heads = setup("llama")
    names = ["sharp", "random-1"] if sharp_first else ["random-1", "sharp"]
    sharp = names.index("sharp")
    proposer = build_proposer("route", {n: heads[n] for n in names}, TREE, signal=signal)
    result = generate(target, proposer, prompts(2, seed=4)[0], DecodeConfig(max_new_tokens=NEW))
    assert len(proposer.decisions) == len(result.steps)
    assert [d.step for d in proposer.decisions] == list(range(len(result.steps)))
    share = sum(d.chosen == sharp for d in proposer.decisions) / len(proposer.decisions)
    assert share >= 0.9
    other = 1 - sharp
    for d in proposer.decisions:
        if d.chosen == sharp:
            better = d.scores[sharp] > d.scores[other] if signal == "confidence" else d.scores[sharp] < d.scores[other]
            assert better
    # the step stats agree: any accepted draft came from the routed head
    assert all(s.credited_drafter == proposer.chosen[k] for k, s in enumerate(result.steps) if s.accepted)
    assert proposer.step_info().route_chosen == proposer.chosen[-1]
    assert proposer.step_info().route_scores == proposer.decisions[-1].scores


def test_turn_routing_decides_once_per_turn():
    model, target, heads = setup("llama")
    proposer = build_proposer("route", {"random-1": heads["random-1"], "sharp": heads["sharp"]}, TREE,
                              granularity="turn")
    cfg = DecodeConfig(max_new_tokens=12)
    for turn, prompt in enumerate(prompts(2, seed=6)):
        result = generate(target, proposer, prompt, cfg)
        assert result.tokens == hf_greedy(model, prompt, 12)
        assert [(d.turn, d.step, d.chosen) for d in proposer.turn_decisions()] == [(turn, 0, 1)]
        assert proposer.chosen == [1] * len(result.steps)
        assert proposer.step_info().route_scores is None  # no decision at the last step of the turn
    assert [d.turn for d in proposer.decisions] == [0, 1]


# ---- every head's cache follows the accepted tokens ------------------------------------------------
class Recording:
    def __init__(self, inner: Proposer):
        self.inner, self.trees = inner, []

    def start(self, features, tokens):
        self.inner.start(features, tokens)

    def propose(self):
        self.trees.append(self.inner.propose())
        return self.trees[-1]

    def observe(self, tree, acceptance, features):
        self.inner.observe(tree, acceptance, features)

    def step_info(self):
        return self.inner.step_info()


@pytest.mark.parametrize("compose", ["route", "merge"])
def test_every_head_stays_in_sync_with_the_accepted_tokens(compose):
    """A head that was not verified still drafts, at every step, the tree it would draft if it
    had been started from scratch on the whole committed context."""
    model, target, heads = setup("qwen2")
    recs = [Recording(SingleProposer(heads[n], TREE)) for n in ("fit-a", "fit-b", "random-2")]
    proposer = RoutedProposer(recs) if compose == "route" else MergedProposer(recs, merge_trie)
    prompt = prompts(3, seed=13)[0]
    result = generate(target, proposer, prompt, DecodeConfig(max_new_tokens=NEW))
    assert result.acceptance_length > 1.0  # steps consumed several accepted tokens at once
    out = [prompt + result.tokens[:1 + sum(s.emitted for s in result.steps[:k])] for k in range(len(result.steps))]
    checked = 0
    for k in range(1, len(result.steps), 3):
        context = out[k]
        features = target.encode(torch.tensor([context[:-1]]))[0]
        for i, rec in enumerate(recs):
            if compose == "route" and proposer.chosen[k] == i:
                continue  # only heads that were not verified at this step
            fresh = SingleProposer(rec.inner.head, TREE)
            fresh.start(features, torch.tensor(context))
            tree = fresh.propose()
            assert torch.equal(tree.tokens, rec.trees[k].tokens) and torch.equal(tree.parents, rec.trees[k].parents)
            assert torch.allclose(tree.logp, rec.trees[k].logp, atol=1e-4)
            checked += 1
    assert checked >= 6


# ---- the factory -----------------------------------------------------------------------------------
def test_factory_maps_names_and_refuses_bad_specs():
    _, _, heads = setup("llama")
    two = {"a": heads["fit-a"], "b": heads["random-1"]}
    assert isinstance(build_proposer("single", {"a": heads["fit-a"]}, TREE), SingleProposer)
    assert isinstance(build_proposer("average", two, TREE, weights=[0.3, 0.7]), SingleProposer)
    routed = build_proposer("route", two, TREE, signal="entropy", granularity="turn")
    assert isinstance(routed, RoutedProposer) and routed.signal.name == "entropy" and routed.per_turn
    assert routed.names == ["a", "b"]
    merged = build_proposer("merge", two, TREE, merge_mode="budget")
    assert isinstance(merged, MergedProposer) and merged.names == ["a", "b"]
    for p in (routed, merged):
        assert isinstance(p, Proposer)
    with pytest.raises(ValueError, match="exactly one drafter, got 2"):
        build_proposer("single", two, TREE)
    with pytest.raises(ValueError, match="unknown strategy 'vote'"):
        build_proposer("vote", two, TREE)
    with pytest.raises(ValueError, match="unknown routing signal 'margin'"):
        build_proposer("route", two, TREE, signal="margin")
    with pytest.raises(ValueError, match="unknown merge mode 'union'"):
        build_proposer("merge", two, TREE, merge_mode="union")
    with pytest.raises(ValueError, match="unknown routing granularity"):
        build_proposer("route", two, TREE, granularity="token")
    with pytest.raises(ValueError, match="weights are for --strategy average only"):
        build_proposer("merge", two, TREE, weights=[0.5, 0.5])
    with pytest.raises(ValueError, match="must sum to 1"):
        build_proposer("average", two, TREE, weights=[0.5, 0.6])


def test_routing_signal_ties_go_to_the_first_drafter():
    assert CONFIDENCE.choose([0.2, 0.5, 0.5]) == 1
    lowest = RoutingSignal("entropy", lambda t: 0.0, higher_wins=False)
    assert lowest.choose([1.0, 0.3, 0.3]) == 1


def test_group_arguments_are_checked():
    from taps.propose.merged import MergedProposer
    from taps.propose.routed import RoutedProposer

    for cls in (RoutedProposer, MergedProposer):
        with pytest.raises(ValueError, match=f"{cls.__name__} needs at least one drafter"):
            cls([])
        with pytest.raises(ValueError, match="1 names for 2 drafters"):
            cls([object(), object()], names=["a"])
        with pytest.raises(RuntimeError, match="before start"):
            cls([object()]).propose()
