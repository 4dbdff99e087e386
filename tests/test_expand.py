"""EAGLE-2 expansion: tree shape rules, beam selection, and scores equal to running the head
sequentially along each path (which checks the expansion's attention masks and positions)."""

import math

import pytest
import torch

from conftest import cached_model
from taps.core import kv
from taps.core.config import TreeConfig
from taps.drafter.checkpoint import init_head
from taps.drafter.context import HeadContext, causal_block_mask, consume
from taps.drafter.expand import expand_tree
from taps.core.target import Target
from taps.core.trace import entropy_of

PROMPT = [5, 9, 13, 2, 77, 31, 8, 100]


def setup(seed=0, arch="llama"):
    target = Target(cached_model(arch))
    head = init_head(target.model.config, seed=seed).bind(target.embed_tokens, target.lm_head)
    out = target.prefill(torch.tensor(PROMPT), all_logits=True)
    # tokens [T+1]: prompt + a pending token; pairs (feature_t, token_{t+1})
    ctx = consume(head, None, torch.tensor(PROMPT[1:] + [42]), out.features)
    return target, head, ctx


def sequential_scores(head, ctx, tree, node):
    """Cumulative log-prob and proposing entropy of `node`, running the head one token at a time
    along its path with a copy of the context cache (log-probs over the head's draft vocabulary,
    if it has one: a target id is looked up by its draft index)."""
    path = tree.path_to(node)
    cache = kv.new_cache()
    for layer_src in ctx.cache.layers:
        cache.update(layer_src.keys.clone(), layer_src.values.clone(), 0)
    hidden, length, total, ent = ctx.root_hidden, ctx.length, 0.0, 0.0
    with torch.inference_mode():
        for i, nid in enumerate(path[1:]):
            logp = torch.log_softmax(head.logits(hidden).float(), -1)
            tok = int(tree.tokens[nid])
            index = tok if head.draft_ids is None else int((head.draft_ids == tok).nonzero())
            total += float(logp[index])
            ent = float(entropy_of(logp))
            if i == len(path) - 2:
                break
            mask = causal_block_mask(1, length, hidden.dtype, hidden.device)
            hidden = head(torch.tensor([[tok]]), hidden[None, None], torch.tensor([[length]]), mask, cache)[0, 0]
            length += 1
    return total, ent


@pytest.mark.parametrize("cfg", [TreeConfig(60, 5, 10), TreeConfig(20, 4, 3), TreeConfig(12, 6, 1), TreeConfig(2, 1, 10)])
def test_tree_shape_rules(cfg):
    _, head, ctx = setup()
    tree = expand_tree(head, ctx, cfg, drafter=4)
    assert tree.size <= cfg.total_tokens
    assert int(tree.tokens[0]) == ctx.root_token == 42
    assert int(tree.depth().max()) <= cfg.depth
    assert (tree.drafters[1:] == 1 << 4).all() and tree.credited(1) == 4
    for kids in tree.children():
        toks = [int(tree.tokens[c]) for c in kids]
        assert len(toks) == len(set(toks)) and len(kids) <= cfg.top_k  # distinct siblings
    # a node never scores higher than its parent
    assert (tree.logp[1:] <= tree.logp[tree.parents[1:]] + 1e-6).all()
    # the head's scratch rows are dropped again
    assert kv.cache_length(ctx.cache) == ctx.length


def test_chain_is_top_k_one():
    _, head, ctx = setup()
    tree = expand_tree(head, ctx, TreeConfig(60, 5, 1))
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3, 4]


@pytest.mark.parametrize("cfg", [TreeConfig(60, 5, 10), TreeConfig(200, 3, 4)])
def test_scores_equal_sequential_head(cfg):
    _, head, ctx = setup(seed=1)
    tree = expand_tree(head, ctx, cfg)
    for node in range(1, tree.size):
        logp, ent = sequential_scores(head, ctx, tree, node)
        assert abs(float(tree.logp[node]) - logp) < 1e-4, node
        assert abs(float(tree.entropy[node]) - ent) < 1e-4, node
    assert torch.allclose(tree.confidence, tree.logp.exp())


def test_beam_selection_and_full_budget():
    _, head, ctx = setup(seed=2)
    k, depth = 3, 3
    tree = expand_tree(head, ctx, TreeConfig(1000, depth, k))
    depths = tree.depth()
    # with a budget above the candidate count every candidate is in the tree: k + (depth-1) k^2
    assert tree.size == 1 + k + (depth - 1) * k * k
    for level in range(1, depth):
        nodes = (depths == level).nonzero().flatten()
        beams = nodes[torch.sort(tree.logp[nodes], descending=True, stable=True).indices[:k]]
        expanded = set(tree.parents[depths == level + 1].tolist())
        assert expanded == set(beams.tolist()), f"level {level + 1} must expand the global top-{k} of level {level}"


def test_rerank_keeps_highest_scores():
    _, head, ctx = setup(seed=3)
    full = expand_tree(head, ctx, TreeConfig(1000, 4, 5))
    small = expand_tree(head, ctx, TreeConfig(25, 4, 5))
    best = torch.sort(full.logp[1:], descending=True).values[:24]
    assert torch.allclose(torch.sort(small.logp[1:], descending=True).values, best)
    assert [int(p) < i for i, p in enumerate(small.parents.tolist()) if i > 0] == [True] * 24


def test_expansion_is_deterministic_and_context_consistent():
    target, head, ctx = setup(seed=4)
    a = expand_tree(head, ctx, TreeConfig())
    b = expand_tree(head, ctx, TreeConfig())
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    # consuming the context in two chunks gives the same state as in one
    out = Target(target.model).prefill(torch.tensor(PROMPT), all_logits=True)
    nxt = torch.tensor(PROMPT[1:] + [42])
    first = consume(head, None, nxt[:3], out.features[:3])
    both = consume(head, first, nxt[3:], out.features[3:])
    assert both.length == ctx.length and both.root_token == ctx.root_token
    assert torch.allclose(both.root_hidden, ctx.root_hidden, atol=1e-5)


def test_reduced_vocab_tree_holds_target_ids_and_draft_scores():
    """With a draft vocabulary the tree holds target ids of that vocabulary (never draft indices),
    and its scores and entropies are those of the head's N-way distribution, node for node."""
    _, head, ctx = setup(seed=1)
    ids = torch.arange(7, 384, 5)  # [76] target ids 7, 12, ...: draft index i is never target id i
    head.set_draft_vocab(ids)
    tree = expand_tree(head, ctx, TreeConfig(60, 5, 10))
    assert tree.size == 60 and set(tree.tokens[1:].tolist()) <= set(ids.tolist())
    for node in range(1, tree.size):
        logp, ent = sequential_scores(head, ctx, tree, node)
        assert abs(float(tree.logp[node]) - logp) < 1e-4, node
        assert abs(float(tree.entropy[node]) - ent) < 1e-4, node
    assert float(tree.entropy[1:].max()) <= math.log(len(ids)) + 1e-4  # an entropy over N, not V, outcomes
