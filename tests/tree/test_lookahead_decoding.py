"""Lookahead decoding's pure parts: parameters, the n-gram pool, the guess
trie, the window's layout and mask, its update and slide."""

import pytest
import torch

from specdec.request.lookahead import LookaheadParams, parse_lookahead
from specdec.tree.lookahead import (JacobiWindow, LookaheadState, NgramPool, guess_tree, lookahead_allowed,
                                    window_layout, window_offsets)


def test_parse_and_bounds():
    assert parse_lookahead("4,3,4") == LookaheadParams(4, 3, 4)
    assert LookaheadParams(4, 3, 4).width == 16 and LookaheadParams(4, 3, 4).cells == 7
    for bad in ("4,3", "a,b,c", "4,3,4,1"):
        with pytest.raises(ValueError, match="W,N,G"):
            parse_lookahead(bad)
    with pytest.raises(ValueError, match="ngram must be an integer >= 2"):
        LookaheadParams(4, 1, 4)
    with pytest.raises(ValueError, match="over 64"):
        LookaheadParams(15, 5, 15)


def test_pool_keeps_the_last_g_per_key_most_recent_first():
    pool = NgramPool(ngram=3, guesses=2)
    pool.add((1, 2, 3))
    pool.add((1, 4, 5))
    pool.add((1, 2, 3))            # again: now the most recent
    assert pool.continuations(1) == [(2, 3), (4, 5)]
    pool.add((1, 6, 7))            # a third: the least recent (4, 5) goes
    assert pool.continuations(1) == [(6, 7), (2, 3)]
    assert pool.continuations(9) == []


def test_pool_seeded_with_every_ngram():
    pool = NgramPool(ngram=2, guesses=4)
    pool.add_sequence([5, 6, 5, 7])
    assert pool.continuations(5) == [(7,), (6,)] and pool.continuations(6) == [(5,)]


def test_guess_tree_merges_prefixes_level_by_level():
    tree = guess_tree(9, [(1, 2, 3), (1, 4, 5), (6, 2, 3)], depth=2)
    # root 9; level 1: 1, 6; level 2: 2 (under 1), 4 (under 1), 2 (under 6)
    assert tree.token_list == [9, 1, 6, 2, 4, 2]
    assert tree.parent_list == [-1, 0, 0, 1, 1, 2]
    assert guess_tree(9, [], depth=3).token_list == [9]


def test_window_layout_mask_rows():
    cells, sees = window_layout(3, 4)             # row 0: 2 cells, rows 1 and 2: 3 each
    assert cells == [(0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    slot = {(0, 0): 0, **{cell: 1 + i for i, cell in enumerate(cells)}}
    for i, (r, j) in enumerate(cells):
        want = {slot[(0, c)] for c in range(j + 1)} | {slot[(s, j)] for s in range(1, r + 1)}
        assert set(sees[i].nonzero().flatten().tolist()) == want
    assert window_offsets(3, 4).tolist() == [r + j for r, j in cells]


def test_lookahead_allowed_blocks():
    tree = guess_tree(9, [(1, 2)], depth=2)
    _, sees = window_layout(2, 3)                 # cells (0,1), (1,0), (1,1)
    allowed = lookahead_allowed(tree.ancestor_mask(), sees, prefix_len=4)
    n, m = tree.size, sees.shape[0]
    assert allowed.shape == (n + m, 4 + n + m)
    assert allowed[:, :4].all()
    assert not allowed[:n, 4 + n:].any()                      # no tree node sees a cell
    assert not allowed[n:, 4 + 1:4 + n].any()                 # no cell sees a guess
    assert allowed[n:, 4].all()                               # every cell sees the root


def test_window_step_yields_columns_and_slides():
    params = LookaheadParams(window=3, ngram=3, guesses=2)
    window = JacobiWindow(params, vocab_size=100)
    window.rows = [[11, 12], [20, 21, 22]]
    grams = window.step(root=5, root_next=0, cell_next=[0, 0, 30, 31, 32])
    assert grams == [(5, 20, 30), (11, 21, 31), (12, 22, 32)]
    assert window.rows == [[21, 22], [30, 31, 32]]
    bigram = JacobiWindow(LookaheadParams(window=3, ngram=2, guesses=2), vocab_size=100)
    bigram.rows = [[11, 12]]
    assert bigram.step(root=5, root_next=40, cell_next=[41, 42]) == [(5, 40), (11, 41), (12, 42)]
    assert bigram.rows == [[41, 42]]


def test_state_tree_from_the_prompt_and_window_ngrams():
    state = LookaheadState(LookaheadParams(window=2, ngram=3, guesses=2), vocab_size=50, tokens=[1, 2, 3, 1, 2, 4])
    assert state.tree(1, depth=5).token_list == [1, 2, 4, 3]        # (2, 4) and (2, 3) merged under 2
    assert state.tree(1, depth=1).token_list == [1, 2]
    assert len(state.window.tokens()) == 3
    assert all(0 <= t < 50 for t in state.window.tokens())
    state.window.rows = [[7], [8, 9]]
    state.update(root=1, root_next=0, cell_next=[0, 10, 11])
    assert state.pool.continuations(1)[0] == (8, 10) and state.pool.continuations(7) == [(9, 11)]
    assert torch.equal(torch.tensor(state.window.rows[0]), torch.tensor([9]))
