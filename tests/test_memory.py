"""Remembered estimates (propose/memory.py): a server's drafters start each request from what
earlier requests taught their running estimates, warm but not frozen, and decoding stays lossless."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import hf_greedy, prompts
from test_auto_tree import FLAT, setup_llama
from test_datastore import TREE
from taps.core.config import DecodeConfig, TreeConfig
from taps.core.decode import generate
from taps.core.verify import Acceptance
from taps.drafter.auto_tree import AutoTree, Calibration
from taps.propose.factory import HeadPool, LookupSpec, compose
from taps.propose.lookup import LookupProposer
from taps.propose.memory import CalibrationMemory, HeadMemory, LookupMemory, Rate, VariantMemory
from taps.propose.rest import Datastore
from taps.propose.spec import parse_spec


def test_a_rate_starts_warm_up_to_its_weight_and_remembers_a_bounded_past():
    rate = Rate(memory=100.0)
    assert rate.warm(1.0, 2.0) == (1.0, 2.0)  # nothing remembered: the cold prior
    rate.add(3, 4)
    assert rate.warm(1.0, 2.0, weight=8.0) == (4.0, 6.0)  # all four trials fit the weight
    rate.add(37, 396)  # 40 / 400 in all, past the memory: scaled to 100 trials, the same rate
    assert (rate.hits, rate.trials) == pytest.approx((10.0, 100.0))
    hits, trials = rate.warm(1.0, 2.0, weight=8.0)  # a tenth, as eight trials, over Beta(1, 1)
    assert (hits, trials) == pytest.approx((1.8, 10.0))


def test_a_calibration_starts_from_what_earlier_ones_taught_and_teaches_it_in_turn():
    memory = CalibrationMemory(memory=400.0)
    c = torch.full((300,), 0.5)
    first = Calibration(remembered=memory)
    assert float(first(c[:1])) == pytest.approx(float(Calibration()(c[:1])))  # nothing remembered yet
    first.update(c, torch.zeros(300, dtype=torch.bool))  # 0.5-confident nodes never pass
    assert float(memory.seen.sum()) == 300 and float(memory.hits.sum()) == 0
    second = Calibration(remembered=memory)
    cold = float(Calibration()(c[:1]))
    warm = float(second(c[:1]))
    assert warm == pytest.approx(cold * 4 / (4 + 16))  # the cold prior's 4 nodes beside 16 remembered misses
    assert float(second(torch.tensor([0.001]))) == pytest.approx(float(Calibration()(torch.tensor([0.001]))))
    second.update(c[:200], torch.ones(200, dtype=torch.bool))  # this request's own nodes all pass
    assert float(second(c[:1])) > 0.9  # warm, not frozen: its own evidence wins within the request
    # 500 nodes seen, 400 remembered: every count scaled by 0.8, the rate kept (200 of 500 passed)
    assert float(memory.seen.sum()) == pytest.approx(400.0)
    assert float(memory.hits.sum()) == pytest.approx(200 * 0.8)


def test_a_lookup_proposer_starts_its_rates_from_earlier_requests():
    store = Datastore.of_segments([[3, 4, 10, 11], [3, 4, 10, 12], [3, 4, 20]], depth=4)
    seq = [3, 4, 10, 13, 14, 3, 4]
    memory = LookupMemory()

    def started():
        proposer = LookupProposer(TREE, LookupSpec(datastore=store, store_nodes=None), memory=memory)
        proposer.start(torch.zeros(len(seq) - 1, 4), torch.tensor(seq))
        return proposer

    first = started()
    assert (first.q, first.r) == (0.5, 0.5)
    tree = first.propose()  # prompt lookup's 10 and three datastore nodes promising 1/3 each: all rejected
    first.observe(tree, Acceptance(nodes=torch.tensor([0]), tokens=torch.tensor([4]), bonus=7), torch.zeros(1, 4))
    assert (memory.prompt.hits, memory.prompt.trials) == (0, 1)
    assert (memory.store.hits, memory.store.trials) == pytest.approx((0, 1))
    assert (memory.cells[(2, 1)].hits, memory.cells[(2, 1)].trials) == (0, 1)  # "3 4" matched: n = 2, depth 1
    second = started()  # Beta(1, 1) plus the remembered miss
    assert second.q == pytest.approx(1 / 3) and second.r == pytest.approx(1 / 3)
    # the cell starts from the remembered miss too: 0 / 1 beside CELL_PRIOR trials at q
    assert second.q_at(2, 1) == pytest.approx((0 + 2 * (1 / 3)) / (1 + 2))
    assert LookupProposer(TREE, LookupSpec(datastore=store)).r == 0.5  # without memory: cold


def test_a_pool_that_remembers_keeps_estimates_per_variant_and_head_version():
    _, target, head = setup_llama()
    pool = HeadPool(target, remember=True)
    pool._heads["/h"] = head  # a loaded head, as pool.head() keeps it
    spec = parse_spec("m", "merge-budget:/h,lookup")
    spec_other = parse_spec("s", "/h")
    tree = TreeConfig(32, 6, 4)
    policy = lambda: AutoTree(FLAT, top_k=4)  # noqa: E731

    def made(spec, remember=True):
        return pool.proposer(spec, tree, policy, remember=remember)

    first, second = made(spec), made(spec)
    assert first.proposers[0].policy.calibration.remembered is second.proposers[0].policy.calibration.remembered
    assert first.proposers[1].memory is second.proposers[1].memory
    assert made(spec_other).policy.calibration.remembered is not first.proposers[0].policy.calibration.remembered
    assert made(spec, remember=False).proposers[1].memory is None  # a request that opted out: cold
    assert made(spec, remember=False).proposers[0].policy.calibration.remembered is None
    # a new head version learns afresh; the lookup member's rates outlive it
    pool.replace("/h", copy.deepcopy(head))
    third = made(spec)
    assert third.proposers[0].policy.calibration.remembered is not first.proposers[0].policy.calibration.remembered
    assert third.proposers[1].memory is first.proposers[1].memory
    pool.forget(spec)
    assert made(spec).proposers[1].memory is not first.proposers[1].memory
    study = HeadPool(target)  # a study's pool: every conversation cold
    study._heads["/h"] = head
    assert study.proposer(spec, tree, policy).proposers[1].memory is None


def test_remembering_conversations_decode_losslessly_and_start_warm():
    model, target, head = setup_llama()
    spec = parse_spec("m", "merge-budget:h,lookup")
    memory = VariantMemory()
    heads = {"h": head, "lookup": LookupSpec()}
    cold_seen = float(Calibration().seen.sum())
    for n, prompt in enumerate(p * 2 for p in prompts(3, seed=9)):  # repeats: prompt lookup drafts too
        proposer = compose(spec, heads, TreeConfig(32, 6, 4), lambda: AutoTree(FLAT, top_k=4), memory=memory)
        policy = proposer.proposers[0].policy
        warm_seen = float(policy.calibration.seen.sum())
        assert (warm_seen > cold_seen) == (n > 0)  # every request after the first starts warm
        result = generate(target, proposer, prompt, DecodeConfig(max_new_tokens=24))
        assert result.tokens == hf_greedy(model, prompt, 24)
    remembered: HeadMemory = memory.head(0, head)
    assert float(remembered.calibration.seen.sum()) > 0 and float(remembered.alone.seen.sum()) > 0
    assert memory.lookup(1).prompt.trials > 0
