"""Verification rules on hand-built trees: greedy exactly, sampling statistically.

The sampling checks use a "Markov target" on a vocabulary of 12: the target's logits at a node
depend only on that node's token, so the exact distribution of every emitted token is known.
"""

import math

import pytest
import torch

from taps.core.config import SamplingConfig
from taps.core.tree import DraftTree, drafter_bits
from taps.core.verify import target_probs, verify_greedy, verify_sampling

V = 12


def tree_of(parents, tokens, logp=None, drafter=None):
    n = len(parents)
    drafter = torch.tensor(drafter) if drafter else torch.tensor([-1] + [0] * (n - 1))
    return DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents),
                     logp=torch.tensor(logp, dtype=torch.float) if logp else -torch.arange(n, dtype=torch.float),
                     entropy=torch.zeros(n), drafters=drafter_bits(drafter))


def one_hot_logits(argmaxes, vocab=V):
    logits = torch.zeros(len(argmaxes), vocab)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


# ---- greedy -------------------------------------------------------------------------------------
def test_greedy_walks_the_matching_branch():
    #   0(t=1) -> 1(t=2) -> 3(t=4)
    #          -> 2(t=3) -> 4(t=5) -> 5(t=6)
    tree = tree_of([-1, 0, 0, 1, 2, 4], [1, 2, 3, 4, 5, 6])
    # target argmax at each node: root->3, node2->5, node4->6, node5->9 (bonus)
    acc = verify_greedy(tree, one_hot_logits([3, 0, 5, 0, 6, 9]))
    assert acc.nodes.tolist() == [0, 2, 4, 5]
    assert acc.tokens.tolist() == [1, 3, 5, 6]
    assert acc.bonus == 9 and acc.accepted == 3
    assert acc.new_tokens == [3, 5, 6, 9]


def test_greedy_rejects_at_root():
    tree = tree_of([-1, 0, 0], [1, 2, 3])
    acc = verify_greedy(tree, one_hot_logits([7, 0, 0]))
    assert acc.nodes.tolist() == [0] and acc.bonus == 7 and acc.new_tokens == [7]


def test_greedy_duplicate_tokens_take_longest_match():
    # Two drafters proposed token 2 under the root (nodes 1 and 3); only node 3's child matches.
    tree = tree_of([-1, 0, 1, 0, 3], [1, 2, 8, 2, 4], drafter=[-1, 0, 0, 1, 1])
    logits = one_hot_logits([2, 4, 0, 4, 11])
    acc = verify_greedy(tree, logits)
    assert acc.nodes.tolist() == [0, 3, 4] and acc.bonus == 11


def test_greedy_tie_goes_to_first_tree():
    tree = tree_of([-1, 0, 0], [1, 2, 2], drafter=[-1, 0, 1])
    acc = verify_greedy(tree, one_hot_logits([2, 5, 5]))
    assert acc.nodes.tolist() == [0, 1] and acc.bonus == 5


# ---- sampling -----------------------------------------------------------------------------------
def markov_logits(seed=0, vocab=V, sharp=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, vocab, generator=g) * sharp  # [token, next-token logits]


def tv(p, q):
    return 0.5 * float((p - q).abs().sum())


def tv_bound(n, k, delta=1e-6):
    """With probability >= 1 - delta the empirical distribution of n samples over k outcomes is
    within this TV distance of the truth (Bretagnolle-Huber-Carol)."""
    return 0.5 * math.sqrt(2 * (k * math.log(2) + math.log(1 / delta)) / n)


def sample_steps(tree, table, sampling, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = table[tree.tokens]  # [N, V]: Markov target
    return [verify_sampling(tree, logits, sampling, gen).new_tokens for _ in range(n)]


def empirical(values, vocab=V):
    counts = torch.bincount(torch.tensor(values, dtype=torch.long), minlength=vocab).double()
    return counts / counts.sum()


TREES = {
    # chain 1 -> 4 -> 7 -> 2
    "chain": tree_of([-1, 0, 1, 2], [1, 4, 7, 2]),
    # wide, with token 5 proposed twice under the root and children under both copies
    "duplicates": tree_of([-1, 0, 0, 0, 0, 1, 3, 2], [1, 5, 6, 5, 9, 3, 8, 0],
                          logp=[0, -0.1, -0.2, -0.3, -0.4, -0.5, -0.6, -0.7], drafter=[-1, 0, 0, 1, 1, 0, 1, 0]),
    # deep and bushy
    "bushy": tree_of([-1, 0, 0, 1, 1, 2, 3, 3, 6], [1, 2, 3, 4, 5, 6, 7, 8, 9]),
}


@pytest.mark.parametrize("name", sorted(TREES))
@pytest.mark.parametrize("sampling", [SamplingConfig(1.0), SamplingConfig(0.7, top_p=0.9), SamplingConfig(1.3, top_k=5)])
def test_sampling_preserves_target_distribution(name, sampling):
    tree, table, n = TREES[name], markov_logits(seed=1), 12000
    for child, parent in enumerate(tree.parents.tolist()):  # make drafted edges likely, so they get accepted
        if parent >= 0:
            table[tree.tokens[parent], tree.tokens[child]] += 4.0
    steps = sample_steps(tree, table, sampling, n)
    bound = tv_bound(n, V)
    # First emitted token ~ target distribution at the root.
    p_root = target_probs(table[tree.tokens[0]], sampling)
    first = empirical([s[0] for s in steps])
    assert tv(first, p_root) < bound
    # Second emitted token, given the first was a drafted child x: ~ target distribution after x.
    x = max(set(int(tree.tokens[c]) for c in tree.children()[0]), key=lambda t: sum(s[0] == t for s in steps))
    seconds = [s[1] for s in steps if s[0] == x and len(s) > 1]
    assert len(seconds) == sum(s[0] == x for s in steps)  # an accepted draft token is always followed
    assert len(seconds) > 500
    assert tv(empirical(seconds), target_probs(table[x], sampling)) < tv_bound(len(seconds), V)
    # Control: the test can tell a wrong distribution apart (half the mass moved to the first child).
    wrong = 0.5 * p_root + 0.5 * torch.nn.functional.one_hot(tree.tokens[1], V).double()
    assert tv(first, wrong) > 5 * bound


def test_sampling_full_acceptance_case():
    # The target is (numerically) certain of the chain: every node is accepted every time.
    table = torch.full((V, V), -30.0)
    chain = [1, 4, 7, 2, 9]
    for a, b in zip(chain, chain[1:]):
        table[a, b] = 30.0
    table[9, 3] = 30.0
    tree = tree_of([-1, 0, 1, 2, 3], chain)
    steps = sample_steps(tree, table, SamplingConfig(1.0), 200)
    assert all(s == [4, 7, 2, 9, 3] for s in steps)


def test_sampling_is_seeded_and_reproducible():
    tree, table = TREES["bushy"], markov_logits(seed=2)
    a = sample_steps(tree, table, SamplingConfig(1.0), 300, seed=5)
    b = sample_steps(tree, table, SamplingConfig(1.0), 300, seed=5)
    c = sample_steps(tree, table, SamplingConfig(1.0), 300, seed=6)
    assert a == b and a != c


def test_duplicate_tokens_are_tried_once():
    # Token 5 twice under the root: with p(5) = 0.5 it must be accepted ~50% of the time, not ~75%
    # (which trying it twice would give).
    table = torch.full((V, V), -30.0)
    table[1, 5] = 0.0
    table[1, 6] = 0.0
    tree = tree_of([-1, 0, 0], [1, 5, 5], drafter=[-1, 0, 1])
    steps = sample_steps(tree, table, SamplingConfig(1.0), 8000)
    share = sum(s[0] == 5 for s in steps) / len(steps)
    assert abs(share - 0.5) < 0.03


def test_target_probs_filters():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    p = target_probs(logits, SamplingConfig(1.0, top_k=2))
    assert (p[2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0, dtype=torch.float64))
    full = torch.softmax(logits.double(), -1)
    p = target_probs(logits, SamplingConfig(1.0, top_p=0.8))
    # 0.665 + 0.245 = 0.91 >= 0.8: the two most likely tokens are kept, renormalised.
    assert (p[2:] == 0).all() and torch.allclose(p[:2], full[:2] / full[:2].sum())
    with pytest.raises(ValueError):
        target_probs(logits, SamplingConfig(0.0))
