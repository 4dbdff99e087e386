"""Merging several drafters' trees (taps.core.tree.merge_disjoint | merge_trie | merge_budget), checked
exactly on hand-built and random trees, and sampling verification of merged trees with duplicate
tokens checked statistically against a Markov target (as in test_verify.py)."""

from __future__ import annotations

import math

import pytest
import torch

from taps.core.config import SamplingConfig
from taps.core.tree import DraftTree, merge_budget, merge_disjoint, merge_trie, rerank
from taps.core.verify import target_probs, verify_greedy, verify_sampling

V = 12


def tree_of(parents, tokens, logp=None, entropy=None, drafter=0):
    n = len(parents)
    logp = torch.tensor(logp, dtype=torch.float) if logp is not None else -0.1 * torch.arange(n, dtype=torch.float)
    entropy = torch.tensor(entropy, dtype=torch.float) if entropy is not None else torch.zeros(n)
    return DraftTree.drafted(tokens=torch.tensor(tokens), parents=torch.tensor(parents), logp=logp, entropy=entropy,
                             drafter=drafter)


def token_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Token sequence below the root for every node (() at the root)."""
    tokens = tree.tokens.tolist()
    return [tuple(tokens[j] for j in tree.path_to(i)[1:]) for i in range(tree.size)]


# A: 0(t1) -> 1(t5) -> 3(t3)      B: 0(t1) -> 1(t5) -> 2(t8)
#          -> 2(t6)                        -> 3(t9) -> 4(t3)
A = tree_of([-1, 0, 0, 1], [1, 5, 6, 3], logp=[0, -0.2, -1.0, -0.5], entropy=[0, 1.0, 1.0, 2.0], drafter=0)
B = tree_of([-1, 0, 1, 0, 3], [1, 5, 8, 9, 3], logp=[0, -0.1, -0.7, -0.9, -1.5], entropy=[0, 0.5, 0.7, 0.5, 0.6],
            drafter=1)


# ---- disjoint ------------------------------------------------------------------------------------
def test_disjoint_layout_exact():
    m = merge_disjoint([A, B])
    assert m.tokens.tolist() == [1, 5, 6, 3, 5, 8, 9, 3]
    assert m.parents.tolist() == [-1, 0, 0, 1, 0, 4, 0, 6]
    assert [m.credited(i) for i in range(m.size)] == [-1, 0, 0, 0, 1, 1, 1, 1]
    assert m.drafters.tolist() == [0, 1, 1, 1, 2, 2, 2, 2]
    assert m.logp.tolist() == pytest.approx([0, -0.2, -1.0, -0.5, -0.1, -0.7, -0.9, -1.5])
    assert m.entropy.tolist() == pytest.approx([0, 1.0, 1.0, 2.0, 0.5, 0.7, 0.5, 0.6])
    assert m.size == 1 + (A.size - 1) + (B.size - 1)


def test_disjoint_mask_has_no_cross_tree_attention():
    trees = [A, B, A]
    m = merge_disjoint(trees)
    block = torch.cat([torch.full((t.size - 1,), h) for h, t in enumerate(trees)])  # tree of each non-root node
    mask = m.ancestor_mask()
    cross = block[:, None] != block[None, :]
    assert not mask[1:, 1:][cross].any()  # no node sees another tree's node
    assert mask[:, 0].all()  # every node sees the shared root
    # within a tree, the mask is exactly that tree's own ancestor mask
    start = 1
    for tree in trees:
        n = tree.size - 1
        assert torch.equal(mask[start:start + n, start:start + n], tree.ancestor_mask()[1:, 1:])
        start += n


def test_positions_equal_depths():
    for merged in (merge_disjoint([A, B]), merge_trie([A, B]), merge_budget([A, B], 5)):
        assert merged.depth().tolist() == [len(p) for p in token_paths(merged)]
    # and each node keeps the depth it had in its own tree
    m = merge_disjoint([A, B])
    assert m.depth().tolist() == A.depth().tolist() + B.depth()[1:].tolist()


# ---- trie ----------------------------------------------------------------------------------------
def test_trie_exact():
    m = merge_trie([A, B])
    # shared: the root and 5; new from B: 8 (under 5), 9, 3 (under 9)
    assert m.tokens.tolist() == [1, 5, 6, 3, 8, 9, 3]
    assert m.parents.tolist() == [-1, 0, 0, 1, 1, 0, 5]
    assert m.drafters.tolist() == [0, 0b11, 0b01, 0b01, 0b10, 0b10, 0b10]
    assert m.drafter_sets() == [[], [0, 1], [0], [0], [1], [1], [1]]
    # the shared node takes logp / entropy from the drafter that scored it highest (B: -0.1)
    assert m.logp.tolist() == pytest.approx([0, -0.1, -1.0, -0.5, -0.7, -0.9, -1.5])
    assert m.entropy.tolist() == pytest.approx([0, 0.5, 1.0, 2.0, 0.7, 0.5, 0.6])
    # and is credited to the lowest-numbered of its proposers (A), both being in its drafters
    assert [m.credited(i) for i in range(m.size)] == [-1, 0, 0, 0, 1, 1, 1]


def test_identical_trees_trie_and_budget_are_the_single_tree():
    for tree in (A, B):
        for merged in (merge_trie([tree, tree]), merge_trie([tree, tree, tree]), merge_trie([tree]),
                       merge_budget([tree, tree], tree.size)):
            assert merged.tokens.tolist() == tree.tokens.tolist()
            assert merged.parents.tolist() == tree.parents.tolist()
            assert torch.equal(merged.logp, tree.logp) and torch.equal(merged.entropy, tree.entropy)
            assert [merged.credited(i) for i in range(merged.size)] == [-1] + [0] * (tree.size - 1)  # the first drafter


def test_roots_must_agree():
    with pytest.raises(ValueError, match="rooted at token 2"):
        merge_trie([A, tree_of([-1, 0], [2, 5])])
    with pytest.raises(ValueError, match="at least one"):
        merge_disjoint([])


def random_tree(g: torch.Generator, root: int, n: int, vocab: int, drafter: int) -> DraftTree:
    """A random tree with non-increasing scores along paths (like EAGLE-2's) and few distinct
    tokens, so different trees often propose the same token paths."""
    parents, logp = [-1], [0.0]
    for i in range(1, n):
        p = int(torch.randint(0, i, (1,), generator=g))
        parents.append(p)
        logp.append(logp[p] - float(torch.rand((), generator=g)) * 2)
    tokens = [root] + torch.randint(0, vocab, (n - 1,), generator=g).tolist()
    entropy = [0.0] + (torch.rand(n - 1, generator=g) * 3).tolist()
    return tree_of(parents, tokens, logp=logp, entropy=entropy, drafter=drafter)


def best_scores(tree: DraftTree) -> dict[tuple[int, ...], float]:
    """token path -> best logp of the nodes with that path (a random tree may repeat sibling tokens)."""
    out: dict[tuple[int, ...], float] = {}
    for path, score in zip(token_paths(tree), tree.logp.tolist()):
        out[path] = max(score, out.get(path, -math.inf))
    return out


CASES = [(k, seed) for k in (2, 3) for seed in range(15)]


@pytest.mark.parametrize("k, seed", CASES)
def test_trie_is_a_deduplicated_union(k, seed):
    g = torch.Generator().manual_seed(seed)
    trees = [random_tree(g, 7, int(torch.randint(2, 14, (1,), generator=g)), 3, h) for h in range(k)]
    trie, disjoint = merge_trie(trees), merge_disjoint(trees)
    paths = token_paths(trie)
    kids = trie.children()
    tokens = trie.tokens.tolist()
    for node in range(trie.size):  # no two siblings with the same token
        sibling_tokens = [tokens[c] for c in kids[node]]
        assert len(sibling_tokens) == len(set(sibling_tokens))
    assert len(set(paths)) == trie.size  # every token path once
    assert trie.size <= disjoint.size
    assert set(paths) == set(token_paths(disjoint))  # exactly the union of all proposals
    assert trie.depth().tolist() == [len(p) for p in paths]
    # drafters: every tree that proposed the path; logp: the best of their scores
    per_tree = [best_scores(t) for t in trees]
    for node, path in enumerate(paths[1:], start=1):
        owners = [h for h in range(k) if path in per_tree[h]]
        assert trie.drafter_sets()[node] == owners
        assert float(trie.logp[node]) == pytest.approx(max(per_tree[h][path] for h in owners))
        assert trie.credited(node) == min(owners)


def greedy_target(tree: DraftTree, seed: int, vocab: int = 3) -> torch.Tensor:
    """Target logits [N, V] that depend only on each node's token path: the same deterministic
    'target model' for any tree that contains the path."""
    logits = torch.zeros(tree.size, vocab)
    for i, path in enumerate(token_paths(tree)):
        g = torch.Generator().manual_seed(hash((seed,) + path) % (2 ** 31))
        logits[i, int(torch.randint(0, vocab, (1,), generator=g))] = 1.0
    return logits


@pytest.mark.parametrize("k, seed", CASES)
def test_trie_accepts_at_least_as_much_as_disjoint_and_costs_no_more(k, seed):
    g = torch.Generator().manual_seed(100 + seed)
    trees = [random_tree(g, 7, int(torch.randint(2, 14, (1,), generator=g)), 3, h) for h in range(k)]
    trie, disjoint = merge_trie(trees), merge_disjoint(trees)
    for target_seed in range(8):
        a_trie = verify_greedy(trie, greedy_target(trie, target_seed))
        a_disj = verify_greedy(disjoint, greedy_target(disjoint, target_seed))
        assert a_trie.accepted >= a_disj.accepted
        # both emit the target's own greedy tokens, so one is a prefix of the other
        short, long_ = sorted((a_trie.new_tokens, a_disj.new_tokens), key=len)
        assert long_[:len(short) - 1] == short[:-1]
        # and every single tree accepts no more than the merge
        for tree in trees:
            assert verify_greedy(tree, greedy_target(tree, target_seed)).accepted <= a_trie.accepted
    assert trie.size <= disjoint.size


# ---- budget --------------------------------------------------------------------------------------
@pytest.mark.parametrize("k, seed", CASES)
@pytest.mark.parametrize("total", [1, 2, 5, 9])
def test_budget_keeps_the_most_confident_candidates(k, seed, total):
    g = torch.Generator().manual_seed(200 + seed)
    trees = [random_tree(g, 7, int(torch.randint(2, 14, (1,), generator=g)), 4, h) for h in range(k)]
    trie = merge_trie(trees)
    budget = merge_budget(trees, total)
    assert budget.size == min(total, trie.size)
    kept = set(token_paths(budget))
    assert kept <= set(token_paths(trie))
    # everything kept is at least as confident as everything dropped
    scores = dict(zip(token_paths(trie), trie.logp.tolist()))
    dropped = [s for p, s in scores.items() if p not in kept]
    if dropped and budget.size > 1:
        assert min(scores[p] for p in kept if p) >= max(dropped)
    # shared nodes keep their drafters
    drafters = dict(zip(token_paths(trie), trie.drafters.tolist()))
    assert all(drafters[p] == s for p, s in zip(token_paths(budget), budget.drafters.tolist()))
    if trie.size <= total:
        assert torch.equal(budget.tokens, trie.tokens) and torch.equal(budget.parents, trie.parents)


def test_rerank_keeps_parents_even_when_scores_rise_along_a_path():
    # node 2 scores above its parent 1: ranking by the path minimum keeps the tree valid
    tree = tree_of([-1, 0, 1, 0], [1, 2, 3, 4], logp=[0, -2.0, -0.1, -1.0])
    kept = rerank(tree, 3)
    assert kept.tokens.tolist() == [1, 2, 4]  # path minima: node 3 (-1.0), then node 1 (-2.0) before node 2
    assert kept.parents.tolist() == [-1, 0, 0]
    assert rerank(tree, 4) is tree


def test_prune_depth_keeps_drafters():
    m = merge_trie([A, B])
    pruned = m.prune_depth(1)
    assert pruned.tokens.tolist() == [1, 5, 6, 9]
    assert pruned.drafters.tolist() == [0, 0b11, 0b01, 0b10]
    assert pruned.drafter_sets() == [[], [0, 1], [0], [1]]
    # one drafter's tree: every node below the root has that drafter's bit
    assert A.drafters.tolist() == [0, 1, 1, 1] and B.drafter_sets()[1] == [1]


# ---- sampling on merged trees with duplicate tokens -------------------------------------------------
def markov_table(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, V, generator=g) * 2.0  # [token, next-token logits]


def tv(p, q):
    return 0.5 * float((p - q).abs().sum())


def tv_bound(n, k, delta=1e-6):
    return 0.5 * math.sqrt(2 * (k * math.log(2) + math.log(1 / delta)) / n)


def empirical(values):
    counts = torch.bincount(torch.tensor(values, dtype=torch.long), minlength=V).double()
    return counts / counts.sum()


# two drafters that both propose 5 then 3 under the root, and disagree elsewhere
SA = tree_of([-1, 0, 1, 0, 2], [1, 5, 3, 6, 7], logp=[0, -0.2, -0.5, -1.0, -0.9], drafter=0)
SB = tree_of([-1, 0, 1, 0, 1], [1, 5, 3, 9, 0], logp=[0, -0.3, -0.4, -0.6, -0.8], drafter=1)
MERGES = {"disjoint": lambda ts: merge_disjoint(ts), "trie": lambda ts: merge_trie(ts),
          "budget": lambda ts: merge_budget(ts, 6)}


@pytest.mark.parametrize("mode, sampling", [(mode, SamplingConfig(1.0)) for mode in sorted(MERGES)]
                         + [("disjoint", SamplingConfig(0.8, top_p=0.9))])
def test_sampling_on_merged_trees_preserves_target_distribution(mode, sampling):
    tree = MERGES[mode]([SA, SB])
    assert len(set(token_paths(tree))) < tree.size or mode != "disjoint"  # disjoint really has duplicates
    table = markov_table(3)
    for child, parent in enumerate(tree.parents.tolist()):  # drafted edges likely, so drafts get accepted
        if parent >= 0:
            table[tree.tokens[parent], tree.tokens[child]] += 3.0
    n = 6000
    gen = torch.Generator().manual_seed(0)
    logits = table[tree.tokens]  # [N, V]
    steps = [verify_sampling(tree, logits, sampling, gen).new_tokens for _ in range(n)]
    bound = tv_bound(n, V)
    p_root = target_probs(table[1], sampling)
    first = empirical([s[0] for s in steps])
    assert tv(first, p_root) < bound
    # after the token both drafters proposed (5), the next token is distributed as the target's p(.|5)
    seconds = [s[1] for s in steps if s[0] == 5]
    assert len(seconds) > 800
    assert tv(empirical(seconds), target_probs(table[5], sampling)) < tv_bound(len(seconds), V)
    # and after 5, 3 (proposed by both, deeper)
    thirds = [s[2] for s in steps if s[:2] == [5, 3] and len(s) > 2]
    assert len(thirds) > 300
    assert tv(empirical(thirds), target_probs(table[3], sampling)) < tv_bound(len(thirds), V)
    # control: the test tells apart a distribution with half the mass moved to a drafted token
    rare = min({int(tree.tokens[c]) for c in tree.children()[0]}, key=lambda t: float(p_root[t]))
    wrong = 0.5 * p_root + 0.5 * torch.nn.functional.one_hot(torch.tensor(rare), V).double()
    assert tv(first, wrong) > 5 * bound


@pytest.mark.parametrize("mode", sorted(MERGES))
def test_token_proposed_by_two_drafters_is_tried_once(mode):
    # p(5) = p(6) = 0.5 at the root; both drafters propose 5. Trying it twice would accept it ~75%.
    table = torch.full((V, V), -30.0)
    table[1, 5] = table[1, 6] = 0.0
    tree = MERGES[mode]([tree_of([-1, 0], [1, 5], drafter=0), tree_of([-1, 0], [1, 5], drafter=1)])
    gen = torch.Generator().manual_seed(1)
    logits = table[tree.tokens]
    n = 4000
    share = sum(verify_sampling(tree, logits, SamplingConfig(1.0), gen).new_tokens[0] == 5 for _ in range(n)) / n
    assert abs(share - 0.5) < 0.03  # 3.8 standard deviations
