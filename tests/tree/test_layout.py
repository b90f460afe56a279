"""The draft tree's layout: validation of tokens/parents and DraftTree's own checks."""

from __future__ import annotations

import pytest
import torch

from specdec.tree.layout import DraftTree, TreeError, tree_from_lists, validate_tree


@pytest.mark.parametrize("tokens, parents, vocab, problem", [
    ([], [], None, "empty"),
    ([1, 2], [-1], None, "differ in length"),
    ([1, 2], [0, 0], None, r"parents\[0\]"),
    ([1, 2, 3], [-1, 0, -1], None, r"parents\[2\] = -1"),
    ([1, 2, 3], [-1, 2, 0], None, r"parents\[1\] = 2"),
    ([1, 2, 3], [-1, 0, 2], None, r"parents\[2\] = 2"),
    ([1, -2], [-1, 0], None, r"tokens\[1\] = -2 is negative"),
    ([1, 10], [-1, 0], 10, r"tokens\[1\] = 10 is outside"),
    ([1, 2.5], [-1, 0], None, r"tokens\[1\].*not an integer"),
    ([1, True], [-1, 0], None, r"tokens\[1\].*not an integer"),
    (torch.tensor([1.0, 2.0]), [-1, 0], None, "tokens must hold integers"),
    ([1, 2], torch.tensor([[-1, 0]]), None, "parents must be 1-D"),
    ("ab", [-1, 0], None, "tokens must be"),
    (5, [-1], None, "tokens must be"),
])
def test_validate_tree_rejects(tokens, parents, vocab, problem):
    with pytest.raises(TreeError, match=problem):
        validate_tree(tokens, parents, vocab)
    with pytest.raises(TreeError, match=problem):
        tree_from_lists(tokens, parents, vocab)


def test_tree_from_lists():
    tree = tree_from_lists(torch.tensor([5, 6, 7, 8], dtype=torch.int32), [-1, 0, 0, 2], vocab_size=9)
    validate_tree([5], torch.tensor([-1]))
    assert tree.depths.tolist() == [0, 1, 1, 2]
    assert tree.tokens.dtype == torch.int64 and tree.values.tolist() == [0.0] * 4
    assert tree.paths() == [[0, 1], [0, 2, 3]]
    # each node sees itself and its ancestors: 3 -> 2 -> 0
    assert tree.ancestor_mask().tolist() == [[True, False, False, False],
                                             [True, True, False, False],
                                             [True, False, True, False],
                                             [True, False, True, True]]


def test_draft_tree_checks_its_fields():
    good = tree_from_lists([1, 2], [-1, 0])
    with pytest.raises(TreeError, match="depths"):
        DraftTree(good.tokens, good.parents, torch.tensor([0, 2]), good.values)
    with pytest.raises(TreeError, match="values"):
        DraftTree(good.tokens, good.parents, good.depths, good.values.double())
    with pytest.raises(TreeError, match=r"parents\[1\]"):
        DraftTree(good.tokens, torch.tensor([-1, -1]), good.depths, good.values)
