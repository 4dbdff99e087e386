"""The head gate of a budget merge with prompt lookup (propose/head_gate.py) and the lazy consume
it relies on (propose/single.py): the gate's arithmetic and learning on hand-made trees, a head
that skipped steps drafting what a head that drafted every step drafts, and greedy identity with
steps skipped."""

from __future__ import annotations

import pytest
import torch

from conftest import cached_model, hf_greedy, prompts
from taps.core.config import DecodeConfig, TreeConfig
from taps.core.decode import generate
from taps.core.tree import DraftTree, merge_trie
from taps.drafter.auto_tree import AutoTree, StepCosts
from taps.drafter.fit import fit_linear_head, greedy_sequences
from taps.core.target import Target
from taps.propose.factory import LookupSpec, build_proposer
from taps.propose.head_gate import EXPLORE_EVERY, GateState, HeadGate, band_of
from taps.propose.memory import VariantMemory
from taps.propose.single import SingleProposer

LINEAR = StepCosts(verify_ms={1: 10.0, 129: 138.0}, level_ms={1: 1.0, 16: 1.0})  # 1 ms a tree token


def _chain(tokens, probs, drafter):
    n = len(tokens)
    return DraftTree.drafted(tokens=torch.tensor([0] + tokens), parents=torch.tensor([-1] + list(range(n))),
                             logp=torch.log(torch.tensor([1.0] + probs)), entropy=torch.zeros(n + 1), drafter=drafter)


def test_bands_split_what_lookup_offers():
    assert [band_of(g) for g in (0.0, 0.49, 0.5, 1.0, 2.5, 4.9, 5.0, 7.9, 8.0, 40.0)] == [0, 0, 1, 2, 3, 4, 5, 5, 6, 6]


def test_a_bands_estimate_leans_on_the_mean_over_every_band():
    state = GateState()
    assert state.expected(3) == (1.0, 0.0)  # nothing measured: one marginal token, no nodes
    state.add(5, 0.0, 1.0)
    state.add(5, 0.0, 1.0)
    state.add(0, 3.0, 2.0)
    pooled_gain, pooled_nodes = (3.0 + 1.0) / 4.0, 4.0 / 4.0
    assert state.expected(5) == pytest.approx(((0.0 + 2 * pooled_gain) / 4, (2.0 + 2 * pooled_nodes) / 4))
    assert state.expected(0) == pytest.approx(((3.0 + 2 * pooled_gain) / 3, (2.0 + 2 * pooled_nodes) / 3))
    assert state.expected(2) == pytest.approx((pooled_gain, pooled_nodes))  # a band never seen: the pooled mean


def test_the_gate_drafts_until_measured_then_skips_only_where_the_heads_do_not_pay():
    policy = AutoTree(LINEAR, top_k=4)
    policy.given = (6.0, 8)  # lookup offers a confident 8-node chain
    assert HeadGate(policy, sized=0b01).drafts()  # nothing measured yet: the heads draft
    # measured: 5 ms of drafting; beside an offer of 5-8 tokens the heads added nothing in 20
    # steps, beside one under half a token 1.5 tokens a step
    state = GateState(draft_ms=5.0)
    for _ in range(20):
        state.add(band_of(6.0), 0.0, 1.0)
        state.add(band_of(0.2), 1.5, 2.0)
    gate = HeadGate(policy, sized=0b01, state=state)
    gain, nodes = state.expected(band_of(6.0))
    assert gain < 0.1
    # lookup alone: 7 / 18 ms = 0.389 tokens per ms; with the heads (7 + gain) / (18 + nodes + 5) ms
    decisions = [gate.drafts() for _ in range(2 * EXPLORE_EVERY)]
    assert decisions.count(True) == 2 and decisions[EXPLORE_EVERY - 1] and decisions[-1]  # explores now and then
    policy.given = (0.2, 1)  # lookup offers little: 1.2 / 11 ms alone, about 2.6 / 18 ms with the heads
    assert gate.drafts()
    policy.given = (6.0, 0)  # lookup has nothing that pays: always draft
    assert gate.drafts()
    cheap = HeadGate(policy, sized=0b01, state=GateState(draft_ms=0.5))
    policy.given = (6.0, 8)
    assert cheap.drafts()  # nothing measured: a token for half a millisecond pays


def test_the_gate_credits_the_heads_only_with_what_lookup_did_not_propose():
    policy = AutoTree(LINEAR, top_k=4)
    gate = HeadGate(policy, sized=0b01)
    policy.given = (1.5, 2)
    band = band_of(1.5)
    assert gate.drafts()
    tree = merge_trie([_chain([5, 6, 7], [0.9, 0.8, 0.7], 0), _chain([5, 8], [0.9, 0.5], 1)])
    gate.observe(tree, [5, 6, 7, 3])  # lookup's 5, then the head's 6 and 7: two marginal tokens
    assert (gate.state.gain[band], gate.state.nodes[band], gate.state.steps[band]) == (2.0, 2.0, 1.0)  # 6, 7: the head's
    gate.observe(merge_trie([_chain([5, 6], [0.9, 0.8], 0), _chain([5, 6, 9], [0.9, 0.8, 0.7], 1)]), [5, 6, 9, 3])
    assert gate.state.steps[band] == 1.0  # observed once per drafted step only
    assert gate.drafts()
    gate.observe(merge_trie([_chain([5, 6], [0.9, 0.8], 0), _chain([5, 6, 9], [0.9, 0.8, 0.7], 1)]), [5, 6, 9, 3])
    assert (gate.state.gain[band], gate.state.nodes[band], gate.state.steps[band]) == (2.0, 2.0, 2.0)  # lookup's path
    gate.state.draft_ms = 1e4  # drafting now priced far above what it adds
    assert not gate.drafts()
    gate.observe(tree, [5, 6, 7, 3])
    assert gate.state.steps[band] == 2.0  # a skipped step teaches nothing


def test_a_head_that_waited_drafts_what_a_head_that_drafted_every_step_drafts():
    """Lazy consume: a head that observed k steps without drafting catches up in one forward and
    then drafts the tree a head that consumed every step drafts."""
    model = cached_model("qwen2")
    target = Target(model)
    g = torch.Generator().manual_seed(1)
    head = fit_linear_head(target, greedy_sequences(
        target, torch.randint(0, model.config.vocab_size, (12, 6), generator=g).tolist(), 32), seed=3)
    tree = TreeConfig(16, 4, 4)
    every, waited = SingleProposer(head, tree), SingleProposer(head, tree)
    prompt = prompts(1, seed=5)[0]
    result = generate(target, every, prompt, DecodeConfig(max_new_tokens=20))
    assert every.consumed == len(result.steps)  # the prompt at start, then one step at a time
    assert every.last_catch_up_s == 0.0  # each drafted step caught up on one step only
    # the same steps observed, drafting nothing until the end
    context = prompt + result.tokens
    features = target.encode(torch.tensor([context[:-1]]))[0]  # [T - 1, F]
    waited.start(features[:len(prompt) - 1], torch.tensor(prompt))
    at = len(prompt)
    from taps.core.verify import Acceptance
    for k, step in enumerate(result.steps):
        emitted = context[at:at + step.emitted]
        acc = Acceptance(nodes=torch.arange(len(emitted)), tokens=torch.tensor([context[at - 1]] + emitted[:-1]),
                         bonus=emitted[-1])
        waited.observe(DraftTree.root_only(context[at - 1]), acc, features[at - 1:at - 1 + len(emitted)])
        at += len(emitted)
    fresh = SingleProposer(head, tree)
    fresh.start(features[:at - 1], torch.tensor(context[:at]))
    a, b = waited.propose(), fresh.propose()
    assert waited.consumed == 2  # the prompt at start, then every step in one forward
    assert waited.last_catch_up_s > 0.0  # a gap, which the head gate does not count as a step's drafting
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    assert torch.allclose(a.logp, b.logp, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_merge_whose_gate_skips_the_head_stays_lossless_and_the_head_catches_up(arch):
    """With drafting priced far above what the head adds, the gate leaves the head out wherever
    lookup offers a copy (the head's tree: the root alone) and lets it draft now and then; greedy
    output is the target's, token for token, and the head drafts in sync after every skip."""
    model = cached_model(arch)
    target = Target(model)
    g = torch.Generator().manual_seed(1)
    head = fit_linear_head(target, greedy_sequences(
        target, torch.randint(0, model.config.vocab_size, (12, 6), generator=g).tolist(), 32), seed=3)
    memory = VariantMemory()
    state = memory.gate(head)
    state.draft_ms = 1e4  # drafting priced at ten seconds: skip wherever lookup has something that pays
    from taps.propose.factory import compose
    from taps.propose.spec import VariantSpec

    spec = VariantSpec("m", "merge", (("head", "head"), ("lookup", "lookup")), merge_mode="budget")
    proposer = compose(spec, {"head": head, "lookup": LookupSpec()}, TreeConfig(32, 6, 4),
                       policy=lambda: AutoTree(LINEAR, top_k=4), memory=memory)
    assert proposer.gate.state is state
    prompt = prompts(1, seed=3)[0][:12] * 4  # a repeated span: prompt lookup copies it
    result = generate(target, proposer, prompt, DecodeConfig(max_new_tokens=40))
    assert result.tokens == hf_greedy(model, prompt, 40)
    sizes = [r.input_sizes for r in proposer.records]
    skipped = [k for k, d in enumerate(proposer.gate.decisions) if not d]
    assert skipped and all(sizes[k][0] == 1 for k in skipped)  # the head's tree was the root alone
    drafted = [k for k, d in enumerate(proposer.gate.decisions) if d]
    assert any(k > skipped[0] for k in drafted)  # and it drafted again after a skip
    head_proposer = proposer.proposers[0]
    # the prompt at start, then one catch-up forward per drafted step after the first
    assert head_proposer.consumed == 1 + sum(1 for k in drafted if k > 0)
