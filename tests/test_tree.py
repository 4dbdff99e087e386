"""Exact checks of DraftTree on hand-built trees: depths, ancestor mask, paths, pruning, masks."""

import pytest
import torch

from taps.core.tree import DraftTree, additive_mask


def make_tree(parents, tokens=None):
    n = len(parents)
    tokens = tokens if tokens is not None else list(range(100, 100 + n))
    return DraftTree.drafted(tokens=torch.tensor(tokens), parents=torch.tensor(parents),
                             logp=-torch.arange(n, dtype=torch.float) * 0.1, entropy=torch.zeros(n), drafter=0)


#        0
#      / | \
#     1  2  3
#    / \     \
#   4   5     6
#   |
#   7
PARENTS = [-1, 0, 0, 0, 1, 1, 3, 4]


def test_depth_and_positions():
    tree = make_tree(PARENTS)
    assert tree.depth().tolist() == [0, 1, 1, 1, 2, 2, 2, 3]


def test_ancestor_mask_exact():
    tree = make_tree(PARENTS)
    expected = torch.zeros(8, 8, dtype=torch.bool)
    for node in range(8):
        for anc in tree.path_to(node):
            expected[node, anc] = True
    assert torch.equal(tree.ancestor_mask(), expected)
    # Spot checks written out by hand.
    assert tree.ancestor_mask()[7].nonzero().flatten().tolist() == [0, 1, 4, 7]
    assert tree.ancestor_mask()[6].nonzero().flatten().tolist() == [0, 3, 6]
    assert tree.ancestor_mask()[2].nonzero().flatten().tolist() == [0, 2]


def test_paths_exact():
    tree = make_tree(PARENTS)
    assert tree.paths().tolist() == [[0, 2, -1, -1], [0, 1, 5, -1], [0, 3, 6, -1], [0, 1, 4, 7]]


def test_children_in_node_order():
    assert make_tree(PARENTS).children() == [[1, 2, 3], [4, 5], [], [6], [7], [], [], []]


def test_prune_depth_keeps_a_valid_tree():
    tree = make_tree(PARENTS)
    pruned = tree.prune_depth(1)
    assert pruned.tokens.tolist() == [100, 101, 102, 103]
    assert pruned.parents.tolist() == [-1, 0, 0, 0]
    two = tree.prune_depth(2)
    assert two.parents.tolist() == [-1, 0, 0, 0, 1, 1, 3]
    assert tree.prune_depth(0).size == 1
    assert tree.prune_depth(10) is tree


def test_root_only():
    tree = DraftTree.root_only(7)
    assert tree.size == 1 and tree.depth().tolist() == [0] and tree.paths().tolist() == [[0]]


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, 0, 3, 1], [-1, -1]])
def test_invalid_parents_rejected(parents):
    with pytest.raises(ValueError):
        make_tree(parents)


def test_field_shape_checked():
    with pytest.raises(ValueError, match="logp"):
        DraftTree(tokens=torch.tensor([1, 2]), parents=torch.tensor([-1, 0]), logp=torch.zeros(3),
                  entropy=torch.zeros(2), drafters=torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match="drafters"):
        DraftTree(tokens=torch.tensor([1, 2]), parents=torch.tensor([-1, 0]), logp=torch.zeros(2),
                  entropy=torch.zeros(2), drafters=torch.ones(3, dtype=torch.long))


def test_additive_mask_prefix_and_window():
    tree = make_tree(PARENTS)
    mask = additive_mask(tree.ancestor_mask(), tree.depth(), prefix=3, window=None, dtype=torch.float32)
    assert mask.shape == (1, 1, 8, 11)
    visible = mask[0, 0] == 0
    assert visible[:, :3].all()  # every node sees the committed prefix
    assert torch.equal(visible[:, 3:], tree.ancestor_mask())
    # window 3: node 7 (depth 3, position 6) sees positions 4..6 only -> nodes 1 (pos 4), 4 (pos 5), 7
    win = additive_mask(tree.ancestor_mask(), tree.depth(), prefix=3, window=3, dtype=torch.float32)[0, 0] == 0
    assert win[7].nonzero().flatten().tolist() == [3 + 1, 3 + 4, 3 + 7]
    # the root (position 3) sees prefix positions 1, 2 and itself
    assert win[0].nonzero().flatten().tolist() == [1, 2, 3]


def test_token_paths_pool_nodes_that_spell_the_same_tokens():
    from taps.core.tree import TokenPaths, merge_disjoint

    # two drafters' trees under root 9: both propose 5 -> 6; the first also 5 -> 7, the second 8
    a = DraftTree.drafted(tokens=torch.tensor([9, 5, 6, 7]), parents=torch.tensor([-1, 0, 1, 1]),
                          logp=torch.tensor([0.0, -0.1, -0.5, -0.3]), entropy=torch.zeros(4), drafter=0)
    b = DraftTree.drafted(tokens=torch.tensor([9, 5, 6, 8]), parents=torch.tensor([-1, 0, 1, 0]),
                          logp=torch.tensor([0.0, -0.2, -0.4, -0.9]), entropy=torch.zeros(4), drafter=0)
    merged = merge_disjoint([a, b])  # nodes 1-3 from a, 4-6 from b: 5 at 1 and 4, 6 at 2 and 5
    paths = TokenPaths(merged)
    assert paths.options([0]) == {5: [1, 4], 8: [6]}  # one option per token, best score first
    assert list(paths.options([1, 4])) == [7, 6]  # pooled children: 7 (-0.3) before 6 (-0.4, -0.5)
    assert paths.follow([5, 6, 1]) == [[0], [1, 4], [2, 5]]  # as far as the tree holds the path
    assert paths.follow([8]) == [[0], [6]] and paths.follow([4]) == [[0]] and paths.follow([]) == [[0]]
