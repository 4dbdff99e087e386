"""Step traces: exact values on a hand-built tree, and tracing never changes what is decoded."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import cached_model, prompts
from taps.core.config import DecodeConfig, SamplingConfig, TreeConfig
from taps.core.decode import generate
from taps.drafter.checkpoint import init_head
from taps.propose.single import SingleProposer
from taps.core.target import Target
from taps.core.trace import entropy_of, step_trace
from taps.core.tree import DraftTree
from taps.core.verify import Acceptance


def hand_tree() -> DraftTree:
    # root 0 -> 1 -> 3 ; root -> 2 ; 1 -> 4
    return DraftTree.drafted(tokens=torch.tensor([5, 6, 7, 8, 9]), parents=torch.tensor([-1, 0, 0, 1, 1]),
                             logp=torch.tensor([0.0, -0.1, -1.0, -0.5, -2.0]),
                             entropy=torch.tensor([0.0, 0.3, 0.3, 0.7, 0.7]), drafter=0)


def test_trace_of_a_known_step():
    tree = hand_tree()
    logits = torch.zeros(5, 4)
    logits[1] = torch.tensor([10.0, 0.0, 0.0, 0.0])  # nearly deterministic at node 1
    acc = Acceptance(nodes=torch.tensor([0, 1]), tokens=torch.tensor([5, 6]), bonus=3)
    t = step_trace(tree, acc, logits)
    assert t.accepted_confidence == pytest.approx([math.exp(-0.1)])
    assert t.accepted_entropy == pytest.approx([0.3])
    assert t.rejected_confidence == pytest.approx([math.exp(-1.0), math.exp(-0.5), math.exp(-2.0)])
    assert t.rejected_entropy == pytest.approx([0.3, 0.7, 0.7])
    assert t.verifier_entropy_accepted == pytest.approx([math.log(4)])  # uniform at the root
    assert t.verifier_entropy_rejected == pytest.approx(float(entropy_of(torch.log_softmax(logits[1], -1))))  # node 1 has children 3, 4
    assert t.verifier_entropy_rejected < 0.01


def test_entropy_counts_impossible_tokens_as_zero():
    uniform = torch.log_softmax(torch.zeros(4), -1)
    assert float(entropy_of(uniform)) == pytest.approx(math.log(4))
    filtered = torch.tensor([math.log(0.5), math.log(0.5), -math.inf, -math.inf])  # a top-k filtered distribution
    assert float(entropy_of(filtered)) == pytest.approx(math.log(2))  # not NaN
    assert float(entropy_of(torch.tensor([0.0, -math.inf]))) == 0.0  # certain


def test_no_rejected_position_at_a_leaf():
    tree = hand_tree()
    acc = Acceptance(nodes=torch.tensor([0, 1, 3]), tokens=torch.tensor([5, 6, 8]), bonus=0)
    t = step_trace(tree, acc, torch.zeros(5, 4))
    assert t.verifier_entropy_rejected is None
    assert len(t.verifier_entropy_accepted) == 2 and len(t.rejected_entropy) == 2


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tracing_changes_nothing_decoded(temperature):
    model = cached_model("llama")
    target = Target(model)
    head = init_head(model.config, seed=3).bind(target.embed_tokens, target.lm_head)
    for prompt in prompts(2, seed=7):
        runs = []
        for trace in (False, True):
            cfg = DecodeConfig(max_new_tokens=20, sampling=SamplingConfig(temperature=temperature), seed=5, trace=trace)
            runs.append(generate(target, SingleProposer(head, TreeConfig(20, 4, 4)), prompt, cfg))
        plain, traced = runs
        assert traced.tokens == plain.tokens
        assert [s.accepted for s in traced.steps] == [s.accepted for s in plain.steps]
        assert all(s.trace is None for s in plain.steps)
        for step in traced.steps:
            t = step.trace
            assert len(t.accepted_confidence) == step.accepted
            assert len(t.accepted_confidence) + len(t.rejected_confidence) == step.tree_size - 1
            assert all(0.0 <= c <= 1.0 for c in t.accepted_confidence + t.rejected_confidence)
        assert traced.trace_s > 0.0
