"""Greedy acceptance by replay (core/replay.py) equals real decoding in float32: the same tokens,
the same accepted length, tree size and provenance at every step, the same traces, for single
heads, prompt lookup, disjoint merges (duplicate token paths), trie and budget merges and routing,
with and without stop tokens; and it refuses what it cannot measure."""

from __future__ import annotations

import pytest
import torch

from conftest import llama_with_head, prompts
from taps.core.config import DecodeConfig, SamplingConfig, TreeConfig
from taps.core.decode import generate
from taps.core.replay import greedy_reference, replay
from taps.drafter.checkpoint import init_head
from taps.propose.factory import build_proposer
from taps.propose.lookup import LookupSpec

TREE = TreeConfig(24, 5, 4)


def repetitive(n: int) -> list[list[int]]:
    """Prompts that repeat a phrase (prompt lookup finds matches) and random ones."""
    out = []
    for i, p in enumerate(prompts(n, seed=7)):
        out.append((p[:6] * 4)[:24] if i % 2 == 0 else p)
    return out


def members(target, head):
    other = init_head(target.model.config, seed=5).bind(target.embed_tokens, target.lm_head)
    return {
        "single": lambda: build_proposer("single", {"h": head}, TREE),
        "lookup": lambda: build_proposer("single", {"lookup": LookupSpec()}, TREE),
        "merge-disjoint": lambda: build_proposer("merge", {"a": head, "b": head}, TREE),  # every path twice
        "merge-trie": lambda: build_proposer("merge", {"a": head, "lookup": LookupSpec()}, TREE, merge_mode="trie"),
        "merge-budget": lambda: build_proposer("merge", {"a": head, "lookup": LookupSpec()}, TREE, merge_mode="budget"),
        "route": lambda: build_proposer("route", {"a": head, "b": other}, TREE),
    }


def steps_of(result):
    return [(s.accepted, s.emitted, s.tree_size, s.credited_drafter, s.drafters) for s in result.steps]


def test_replay_equals_real_decoding_in_float32():
    _, target, head = llama_with_head()
    accepted = 0
    for name, make in members(target, head).items():
        for i, prompt in enumerate(repetitive(4)):
            cfg = DecodeConfig(max_new_tokens=40, trace=True)
            if i % 2 == 1:  # a stop token the answer reaches: its 10th token
                cfg = DecodeConfig(max_new_tokens=40, trace=True,
                                   stop_token_ids=(generate(target, None, prompt, cfg).tokens[9],))
            real = generate(target, make(), prompt, cfg)
            ref = greedy_reference(target, prompt, cfg)
            assert ref.tokens == real.tokens  # lossless: the plain continuation is the speculative one
            again = replay(make(), ref, cfg)
            assert again.tokens == real.tokens and again.stop_reason == real.stop_reason, name
            assert steps_of(again) == steps_of(real), name
            for a, b in zip(again.steps, real.steps):
                assert a.target_s == 0.0
                # the head read the reference prefill's features, real decoding the tree forwards': float32 rounding
                assert a.trace.accepted_confidence == pytest.approx(b.trace.accepted_confidence, rel=1e-4, abs=1e-6)
                assert a.trace.rejected_entropy == pytest.approx(b.trace.rejected_entropy, rel=1e-4, abs=1e-6)
                assert a.trace.verifier_entropy_accepted == pytest.approx(b.trace.verifier_entropy_accepted, abs=1e-4)
                if b.trace.verifier_entropy_rejected is None:
                    assert a.trace.verifier_entropy_rejected is None
                else:
                    assert a.trace.verifier_entropy_rejected == pytest.approx(b.trace.verifier_entropy_rejected, abs=1e-4)
            accepted += sum(s.accepted for s in real.steps)
    assert accepted > 50  # the comparison covered accepted drafts, not only rejections


def test_replay_refuses_what_it_cannot_measure():
    _, target, head = llama_with_head()
    prompt = prompts(1, seed=3)[0]
    cfg = DecodeConfig(max_new_tokens=8)
    ref = greedy_reference(target, prompt, cfg)
    make = members(target, head)["single"]
    sampled = DecodeConfig(max_new_tokens=8, sampling=SamplingConfig(temperature=1.0))
    with pytest.raises(ValueError, match="temperature"):
        replay(make(), ref, sampled)
    with pytest.raises(ValueError, match="temperature"):
        greedy_reference(target, prompt, sampled)
    with pytest.raises(ValueError, match="fewer than max_new_tokens"):
        replay(make(), ref, DecodeConfig(max_new_tokens=9))
    with pytest.raises(ValueError, match="trace"):
        replay(make(), ref, DecodeConfig(max_new_tokens=8, trace=True))
    assert replay(make(), ref, DecodeConfig(max_new_tokens=5)).tokens == ref.tokens[:5]
    torch.testing.assert_close(ref.features[:len(prompt)], target.prefill(torch.tensor(prompt)).features)  # the prompt's
    target.reset()
